"""Does the lossy int8 hidden-state codec cost acceptance? (the per-token feature format: ``specdraft.features``).

Dumps the same conversations through the same target twice — ``hidden_codec=fp16`` and
``int8`` (per-token absmax scale) — and reports, in one run:
* bytes per token of each store;
* reconstruction error of the int8 states against fp16, and how often lm_head of the
  decoded state keeps the target's top-1 token;
* the same draft recipe trained on each store (same seed, same batches), evaluated by the
  simulated chain acceptance (alpha_i, sim_tau) on the *fp16* held-out split, so only the
  training data differs.

    python -m benchmarks.codec_acceptance OUT.json [--target DIR] [--conversations 400] [--epochs 4]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from benchmarks.host import write_result
from pipelines.dump import dump_features
from specdraft.configs.features import FeaturesConfig
from specdraft.configs.train import OptimConfig, TrainConfig
from specdraft.plan import build_plan
from specdraft.configs.recipes import RECIPES
from specdraft.run import build_run
from specdraft.store import FeatureDataset
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.loading import load_target_heads
from specdraft.toy.build import build_toy_target
from specdraft.configs.toy import ToyTargetConfig
from specdraft.toy.conversations import generate_conversations


def train_and_score(store: Path, val_store: Path, target: Path, recipe: str, epochs: int, seed: int) -> dict:
    """``recipe`` trained on ``store`` (``build_run``, ``Run.fit``), scored on ``val_store``'s held-out split."""
    stages = len(RECIPES[recipe].stages)
    cfg = TrainConfig(recipe=recipe, epochs=[max(1, epochs // stages)] * stages, min_steps=0, seed=seed,
                      optim=OptimConfig(lr=3e-3, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1),
                      reader=ReaderConfig(max_tokens=1024, val_fraction=0.15, seed=seed))
    plan = build_plan(cfg)
    run = build_run(cfg, plan, target, lambda split, reader, aux: FeatureDataset([store if split == "train" else val_store],
                                                                                 reader, split=split, aux_layers=aux))
    fitted = run.fit(5, 10_000, validate=("after",))
    counts = fitted.after
    return {"sim_tau": counts.sim_tau, "alpha": counts.alpha, "steps": run.trainer.state.step, "train_s": fitted.loop_s}


@torch.no_grad()
def reconstruction(fp16_store: Path, int8_store: Path, target: Path) -> dict:
    """int8 vs fp16 states of the same tokens, and top-1 agreement of lm_head on them."""
    heads = load_target_heads(target)
    a = FeatureDataset([fp16_store], ReaderConfig(max_tokens=4096, shuffle=False), split="all")
    b = FeatureDataset([int8_store], ReaderConfig(max_tokens=4096, shuffle=False), split="all")
    assert a.sample_ids == b.sample_ids, "the two stores hold different samples"
    err_max, err_sum, n, agree = 0.0, 0.0, 0, 0
    for seqs in a.batches(0):
        x, y = a.load(seqs), b.load(seqs)
        valid = x.valid  # (B, T)
        diff = (x.hidden - y.hidden).abs()[valid]  # (N, d)
        err_max = max(err_max, float(diff.max()))
        err_sum += float(diff.mean(-1).sum())
        n += int(valid.sum())
        top_x = (x.hidden[valid] @ heads.lm_head.T).argmax(-1)  # (N,)
        top_y = (y.hidden[valid] @ heads.lm_head.T).argmax(-1)  # (N,)
        agree += int((top_x == top_y).sum())
    return {"tokens": n, "max_abs_err": err_max, "mean_abs_err": err_sum / max(1, n), "top1_agreement": agree / max(1, n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="result JSON path")
    parser.add_argument("--target", help="HF target dir (default: build the toy target under --work)")
    parser.add_argument("--work", default="runs/bench-codec", help="working directory")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--recipe", default="beagle", choices=sorted(RECIPES))
    parser.add_argument("--epochs", type=int, default=4, help="total epochs (split evenly over the recipe's stages)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    target = Path(args.target) if args.target else build_toy_target(work / "target", ToyTargetConfig(), progress=False)
    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(generate_conversations(args.conversations, seed=99))]
    result: dict = {"benchmark": "codec_acceptance", "target": str(target), "recipe": args.recipe,
                    "conversations": args.conversations, "epochs": args.epochs}
    load_start = os.getloadavg()
    stores = {}
    for codec in ("fp16", "int8"):
        summary = dump_features(target, rows, work / f"store-{codec}", FeaturesConfig(hidden_codec=codec, max_length=256),
                                progress=False)
        stores[codec] = work / f"store-{codec}"
        result[codec] = {"bytes_per_token": summary["bytes_per_token"], "tokens": summary["tokens"]}
    result["int8_vs_fp16"] = reconstruction(stores["fp16"], stores["int8"], target)
    for codec in ("fp16", "int8"):
        result[codec].update(train_and_score(stores[codec], stores["fp16"], target, args.recipe, args.epochs, args.seed))
    write_result(args.out, result, threads=args.threads, loadavg_at_start=load_start)
    for codec in ("fp16", "int8"):
        r = result[codec]
        print(f"{codec}: {r['bytes_per_token']:.1f} bytes/token, sim_tau {r['sim_tau']:.3f}, "
              f"alpha {[round(a, 3) for a in r['alpha']]}, {r['steps']} steps")
    print(f"int8 vs fp16 states: {json.dumps(result['int8_vs_fp16'])}")


if __name__ == "__main__":
    main()
