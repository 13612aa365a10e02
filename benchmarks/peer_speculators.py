"""The peer arm of the real-model benchmark (issue 32 item 4): an EAGLE-3 draft trained by ``speculators``.

"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test" (§3) as the vLLM
project's trainer implements it (the ``speculators`` package, its ``train`` command's code driven in process),
trained on the SAME feature store as ``benchmarks.real_model``'s recipes for the same optimizer steps, then
served by the same vLLM measurement (``benchmarks.speculative.engine_acceptance``, the engine's numbers alone)
at K = 3 and K = 5 on the same held-out question files (``real_model.write_question_sets``):

1. ``convert_store``: the store (dumped with ``aux_layers=eagle3``, read with ``specdraft.store``) in
   speculators' offline-training format (its own layout, one directory): a ``datasets.save_to_disk`` dataset
   (``input_ids``, ``loss_mask``, ``seq_len``; the store's training split first, its held-out split last, so
   speculators' ``train_data_ratio`` cut reproduces our split), beside it one ``hidden_states/hs_{i}.safetensors`` per sequence (``token_ids`` [T],
   ``hidden_states`` [T, 4, d]: the 3 aux layers, then the target's last state) and ``token_freq.json`` (the
   training split's loss-masked (assistant) tokens counted as speculators counts them, for its draft vocabulary).
2. ``benchmarks.peer_speculators_train`` in speculators' virtual environment (``--venv``; the project's own
   processes never import speculators): the draft vocabulary built with speculators' own function, then
   speculators' trainer on the CPU with the run-time patches it needs (``PATCHES`` there, copied into the JSON):
   the trainer's ``get_local_rank`` -> "cpu" (its ``.to(self.local_rank)`` of the model and of every batch would
   move to cuda:0); ``_StepTimer.mark`` / ``now`` without ``torch.accelerator.synchronize()`` (it raises without
   an accelerator); ``Trainer.device_type`` "cpu" (upstream falls back to "cuda" for autocast); the draft's
   ``verifier_norm`` -> identity (our store's last state is already the target's final-normed state, speculators'
   is the pre-norm one); each epoch its first ``steps // epochs`` packed batches (``max_train_batches``, as
   real_model.py's ``epoch_batches``; the LR schedule is sized to them). Flags, not patches:
   ``--draft-attn-impl sdpa`` and ``--loss-implementation eager`` (flex attention and the fused losses need
   Triton on a GPU), ``--num-workers 0``, ``--on-missing raise``. The peer's recipe is otherwise its own defaults
   (Muon at lr 1e-3, linear schedule, KL loss over 3 test-time-training steps, one llama layer).
3. vLLM: the last epoch's checkpoint served as is (speculators' format, ``method: eagle3``) beside the target
   alone: acceptance length, tokens/s with and without the draft, the speedup, per question set and K.

Tokens per step: speculators packs sequences into one row of ``--max-tokens`` (``total_seq_len``), our reader
pads batches to at most ``--max-tokens`` padded tokens; both train about ``--max-tokens`` positions a step.
``tokens_per_s`` counts the loss-masked tokens, as real_model.py's recipes count them (``positions_per_s``: all).

    python -m benchmarks.peer_speculators --target T (--store S | --run WORKDIR) [--steps 20 --epochs 2]
        [--max-tokens 2048] [--precision bf16] [--questions FILE...] [--max-questions 5] [--max-new-tokens 64]
        [--venv runs/venv-speculators] [--out benchmarks/results/real_model_peer_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.host import write_result
from specdraft.limits import LoadSampler
from benchmarks.real_model import (ROOT, add_inputs, find_store, number, question_counts, settings_of,
                                   store_facts, target_facts, write_question_sets)

VENV = ROOT / "runs" / "venv-speculators"  # --venv's default: in the checkout (runs/ is not tracked), not /tmp
NAME = "speculators"  # the peer draft's name in the engine's results


def write_hidden_states(store: Path, out: Path, val_fraction: float,
                        samples: list[str] | None = None) -> dict[str, Any]:
    """Every sequence of ``store`` as speculators' ``hs_{i}.safetensors`` under ``out/hidden_states`` (the
    training split first, then the held-out one; ``samples``: the training split only those sample ids, as
    ``benchmarks.recipe_training`` reads them); returns the rows (input_ids, loss_mask, seq_len), the split
    sizes and the predicted-token counts. Needs only the project's own dependencies."""
    import torch
    from safetensors.torch import save_file

    from specdraft.store import FeatureDataset, read_manifest
    from specdraft.configs.reader import ReaderConfig

    manifest = read_manifest(store)
    aux = [int(i) for i in manifest.get("aux_layers") or []]
    if not aux:
        raise SystemExit(f"{store}: no aux_layers (dump it with aux_layers=eagle3): speculators trains EAGLE-3")
    dtype = torch.float16 if manifest["hidden_codec"] == "fp16" else torch.float32  # fp16: the stored values as is
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    sizes, freq = {}, Counter()
    for split in ("train", "val"):
        ds = FeatureDataset([store], ReaderConfig(val_fraction=val_fraction, prefetch=0), split=split,
                            aux_layers=aux, samples=samples if split == "train" else None)
        sizes[split] = len(ds.sample_ids)
        for i in range(len(ds.sample_ids)):
            b = ds.load([i])
            ids, mask = b.input_ids[0], b.loss_mask[0]  # (T,)
            t, d = ids.shape[0], b.hidden.shape[-1]
            states = torch.cat([b.aux_hidden[0].view(t, len(aux), d), b.hidden[0].view(t, 1, d)], dim=1)  # (T, 4, d)
            save_file({"hidden_states": states.to(dtype).contiguous(), "token_ids": ids.long().contiguous()},
                      str(out / "hidden_states" / f"hs_{len(rows['seq_len'])}.safetensors"))
            rows["input_ids"].append(ids.tolist())
            rows["loss_mask"].append(mask.long().tolist())  # assistant tokens, speculators' convention too
            rows["seq_len"].append(t)
            if split == "train":
                freq.update(ids[mask].tolist())  # as speculators counts: the assistant tokens
    return {"rows": rows, "sizes": sizes, "token_freq": freq, "aux_layers": aux, "d": int(manifest["d"])}


def convert_store(store: Path, out: Path, val_fraction: float, samples: list[str] | None = None) -> dict[str, Any]:
    """``store`` in speculators' offline-training format under ``out`` (needs the ``datasets`` package: run it
    in speculators' environment); returns what the trainer needs to know about it."""
    import shutil

    import datasets

    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)  # the benchmark's own directory: a fresh conversion
    written = write_hidden_states(store, out, val_fraction, samples)
    rows, sizes = written.pop("rows"), written.pop("sizes")
    data = datasets.Dataset.from_dict(rows)
    data.set_format(type="torch")
    data.save_to_disk(str(out))  # beside hidden_states/, as speculators lays its data out
    (out / "token_freq.json").write_text(json.dumps({str(k): v for k, v in written.pop("token_freq").items()}))
    total = sizes["train"] + sizes["val"]
    if not sizes["train"] or not sizes["val"]:
        raise SystemExit(f"{store}: {sizes} sequences in the training / held-out split: speculators needs both")
    return {**written, "train_sequences": sizes["train"], "val_sequences": sizes["val"],
            "train_data_ratio": (sizes["train"] + 0.5) / total,  # int(total * ratio) == the training split
            "tokens": sum(rows["seq_len"]), "convert_s": round(time.perf_counter() - started, 2)}


def train_peer(args: argparse.Namespace, store: Path, target: Path, work: Path,
               samples: list[str] | None = None) -> dict[str, Any]:
    """Convert and train in speculators' environment (a subprocess of ``args.venv``'s python); ``samples``: the
    training split only those sample ids (``convert_store``)."""
    request = {"store": str(store), "target": str(target), "work": str(work), "steps": args.steps,
               "epochs": args.epochs, "max_tokens": args.max_tokens, "precision": args.precision,
               "threads": args.threads, "seed": args.seed, "val_fraction": args.val_fraction,
               "draft_vocab": args.draft_vocab, "lr": args.lr, "samples": samples}
    work.mkdir(parents=True, exist_ok=True)
    (work / "request.json").write_text(json.dumps(request, indent=2))
    result = work / "train_result.json"
    result.unlink(missing_ok=True)
    python = args.venv / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "benchmarks.peer_speculators_train", str(work / "request.json"),
                           str(result)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"speculators training failed (exit {proc.returncode}); its log is above")
    return json.loads(result.read_text())


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_inputs(ap)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_model_peer_cpu.json")
    ap.add_argument("--work", type=Path, default=Path("runs/bench-peer"), help="converted data, checkpoints")
    ap.add_argument("--venv", type=Path, default=VENV, help="a virtual environment with speculators installed")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps")
    ap.add_argument("--epochs", type=int, default=2, help="epochs the steps are spread over")
    ap.add_argument("--max-tokens", type=int, default=2048, help="tokens per packed batch (total_seq_len)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default: speculators')")
    ap.add_argument("--draft-vocab", type=int, default=32000,
                    help="draft vocabulary (our EAGLE-3 recipes' default); >= the target's: the whole vocabulary")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="held-out share (real_model.py's)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="speculators' hidden_states_dtype: its autocast dtype (master weights stay fp32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of training")
    ap.add_argument("--questions", type=Path, nargs="+", default=[ROOT / "configs" / "data" / "mt_bench.jsonl"])
    ap.add_argument("--max-questions", type=int, default=5, help="questions per file")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5], help="chain lengths")
    ap.add_argument("--engine-max-len", type=int, default=None, help="vLLM's context (default: the target's)")
    ap.add_argument("--floor", action="store_true", help="vLLM's ngram prompt lookup served too")
    ap.add_argument("--no-engine", action="store_true", help="train only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="a line stored with the result")
    args = ap.parse_args(argv)
    if args.steps < args.epochs:
        ap.error(f"--steps {args.steps} is fewer than --epochs {args.epochs}")
    if not (args.venv / "bin" / "python").is_file():
        ap.error(f"--venv {args.venv}: no bin/python (a virtual environment with speculators installed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from benchmarks.speculative import ENGINE_KEYS, engine_acceptance

    work, target = args.work.resolve(), args.target.resolve()
    store = (args.store or find_store(args.run)).resolve()
    started, engine = time.perf_counter(), {}
    trained: dict[str, Any] = {}

    def write(complete: bool) -> dict[str, Any]:
        result = {
            "benchmark": "real_model_peer", "peer": "speculators", "complete": complete, "note": args.note,
            "settings": settings_of(args), "target": target_facts(target), "store": store_facts(store),
            "questions": question_counts(files),
            "train": trained, "patches": trained.get("patches", []),
            **{f"engine_{k}": {key: e.get(key) for key in ENGINE_KEYS}
               | {"speculators": e[NAME]} | ({"ngram": e["ngram"]} if "ngram" in e else {}) for k, e in engine.items()},
            "host": {"torch_threads": args.threads, "load": load.summary()},  # write_result adds the host's facts
            "total_s": round(time.perf_counter() - started, 1),
        }
        write_result(args.out, result)
        return result

    with LoadSampler() as load:
        files = write_question_sets(args.questions, work / "questions", args.max_questions)
        print("[peer] converting the store and training with speculators ...", file=sys.stderr, flush=True)
        trained.update(train_peer(args, store, target, work / "train"))
        print(f"[peer]   {trained['optimizer_steps']} steps, {trained['train_s']} s, {trained['tokens_per_s']} "
              f"tokens/s", file=sys.stderr, flush=True)
        write(False)
        if not args.no_engine:
            served = {NAME: {"model": trained["draft"], "method": "eagle3"}}  # speculators' format, read by vLLM
            for k in args.k:
                print(f"[peer] vLLM at K={k} ...", file=sys.stderr, flush=True)
                engine[f"k{k}"] = engine_acceptance(target, {}, files, work / f"engine-k{k}", args.max_new_tokens, k,
                                                    floor=args.floor, max_model_len=args.engine_max_len, ours=False,
                                                    served=served)
                write(False)
    result = write(True)
    print_table(result)
    print(f"written: {args.out}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    t = result["train"]
    print(f"speculators EAGLE-3: {t['optimizer_steps']} steps, {t['train_s']:.1f} s, {t['tokens_per_s']:.0f} tokens/s")
    for key in [k for k in result if k.startswith("engine_k")]:
        for name, d in result[key]["speculators"]["datasets"].items():
            print(f"  {key[7:]} {name:12s} vLLM acceptance length {number(d['acceptance_length'])}, "
                  f"{number(d['tokens_per_s'], '.1f')} vs {number(d['tokens_per_s_vanilla'], '.1f')} tokens/s "
                  f"(speedup {number(d['speedup'])})")


if __name__ == "__main__":
    raise SystemExit(main())
