"""Training rate per recipe against the FLOP limit of the same process (issue 41, item 3).

SmolLM2-135M-shaped drafts (d=576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49,152, draft vocabulary
32,000, three auxiliary layers), random weights and synthetic features, every position trained, under bf16
autocast (fp32 master weights, frozen heads in bf16) as ``configs/smollm2.yaml`` trains. Per round, interleaved:
the bf16 matmul FLOP/s (``specdraft.limits.measure_matmul``, the target's MLP shape) and one training step of each
recipe stage (``objectives.train_batch`` + AdamW step), so load changes hit both alike. Per recipe stage:

* ``tokens_per_s``: trained positions per second (median over the rounds);
* ``limit_tokens_per_s``: FLOP/s / FLOPs per position, the FLOPs being 6 x the trainable matmul weights (forward,
  input and weight gradients) + 4 x the frozen output head (forward, input gradient) times the sub-steps that run
  every position (``unrolled``: 1 for Beagle's early and late stages, whose late sub-steps each run only their
  own queries; n for HASS's alignment and EAGLE-3's training-time test);
* ``ratio``: tokens_per_s / limit_tokens_per_s, per round then the median;
* ``step_cpu_s``: the process's CPU seconds per step (all threads; ``threads`` x ``step_s`` on a quiet machine),
  which a loaded machine inflates far less than the wall time: compare it across commits measured under load.

A recipe's rate is the mean of its stages' step times (the stages split its epochs evenly). Each early, late or
align stage's ``substeps``: one more step phase by phase (the prepared targets, each sub-step's forward and
backward; without the optimizer step). For ``eagle3`` the
training-time test's cost step by step: each sub-step's forward (draft + fused head loss) timed as it is yielded,
and the one backward split at the moments each sub-step's output state receives its gradient.

    python -m benchmarks.train_rate OUT.json [--rounds 3] [--seq 1024] [--batch 1] [--threads 2] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks.host import write_result
from specdraft.limits import LoadSampler, measure_matmul

SMOLLM2 = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
               vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
RECIPES = ("beagle3", "hass", "eagle3")


def build(recipe: str, draft_vocab: int, seed: int = 0):
    """A SmolLM2-shaped random draft of ``recipe`` with its frozen heads in bf16, and its stages."""
    from specdraft.configs.draft import DraftConfig
    from specdraft.configs.recipes import RECIPES as TABLE
    from specdraft.models import build_draft, set_frozen_dtype

    row = TABLE[recipe]
    g = torch.Generator().manual_seed(seed)
    vocab, d = SMOLLM2["vocab_size"], SMOLLM2["hidden_size"]
    own = row.own_vocab if row.own_vocab is not None else row.eagle3_features
    cfg = DraftConfig(arch=row.arch, aux_layers=[2, 15, 27] if row.eagle3_features else [],
                      draft_vocab_size=draft_vocab if own else None, **SMOLLM2)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values if own else None
    embed = (torch.randn(vocab, d, generator=g) * 0.02).to(torch.bfloat16)
    head = (torch.randn(vocab, d, generator=g) * 0.02).to(torch.bfloat16)
    draft = build_draft(cfg, embed, head, vocab=ids)
    set_frozen_dtype(draft, torch.bfloat16)
    return draft, row.stages


def batch_of(draft, bsz: int, t: int, seed: int = 0):
    """Synthetic features for ``bsz`` sequences of ``t`` tokens, every position trained (stored top-K of 10)."""
    from specdraft.batch import Batch

    g = torch.Generator().manual_seed(seed)
    cfg = draft.config
    vocab, d = cfg.vocab_size, cfg.hidden_size
    ids = torch.randint(vocab, (bsz, t), generator=g)
    hidden = torch.randn(bsz, t, d, generator=g).to(torch.bfloat16)
    mask = torch.ones(bsz, t, dtype=torch.bool)
    aux = torch.randn(bsz, t, 3 * d, generator=g).to(torch.bfloat16) if cfg.aux_layers else None
    top = torch.randn(bsz, t, 10, generator=g).log_softmax(-1)
    if cfg.own_vocab:  # the stored top-1 inside the draft vocabulary: every position trainable
        emittable = draft.heads.target_ids()
        topk_ids = emittable[torch.randint(emittable.numel(), (bsz, t, 10), generator=g)]
    else:
        topk_ids = torch.randint(vocab, (bsz, t, 10), generator=g)
    return Batch(ids, hidden, mask, mask, topk_ids, top, aux)


def flops_per_position(draft, unrolled: int) -> dict[str, int]:
    """6 x trainable matmul weights + 4 x a frozen output head, per unrolled sub-step (see the module docstring)."""
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad and p.dim() == 2)
    frozen = 0 if draft.config.own_vocab else draft.heads.weight.numel()
    return {"trainable_matmul": trained, "frozen_head": frozen, "unrolled": unrolled,
            "flops": (6 * trained + 4 * frozen) * unrolled}


def unrolled_of(stage) -> int:
    return stage.steps if stage.kind in ("align", "ttt") else 1


def step(draft, optimizer, batch, stage, chunk: int = 1024) -> float:
    """One training step (forward + backward of every sub-step, AdamW step): wall seconds (``step.cpu``: the
    process's CPU seconds in it, every thread's)."""
    from specdraft.objectives import train_batch

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train_batch(draft, batch, stage, generator=torch.Generator().manual_seed(0), chunk=chunk)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step.cpu = time.process_time() - c0
    return time.perf_counter() - t0


def ttt_steps(draft, batch, stage, chunk: int = 1024) -> dict[str, Any]:
    """A training-time-test batch step by step: each sub-step's forward and its share of the one backward."""
    from specdraft.objectives import substeps

    marks: dict[int, float] = {}
    forward, pending = [], None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        steps = substeps(draft, batch, stage, generator=torch.Generator().manual_seed(0), chunk=chunk)
        t0 = time.perf_counter()
        for sub in steps:
            forward.append(time.perf_counter() - t0)
            j = sub.step
            sub.h_hat.register_hook(lambda grad, j=j: marks.setdefault(j, time.perf_counter()) and None)
            pending = sub.weight * sub.loss if pending is None else pending + sub.weight * sub.loss
            t0 = time.perf_counter()
        forward.append(time.perf_counter() - t0)  # after the last yield: nothing but the generator's end
        b0 = time.perf_counter()
        pending.backward()
        b1 = time.perf_counter()
    draft.zero_grad(set_to_none=True)
    order = sorted(marks, reverse=True)  # the last sub-step's state gets its gradient first
    backward, prev = {}, b0
    for j in order:
        backward[j] = round(marks[j] - prev, 4)
        prev = marks[j]
    return {"prepare_and_step1_forward_s": round(forward[0], 4),
            "forward_s_steps_2_on": [round(x, 4) for x in forward[1:-1]],
            "backward_s": round(b1 - b0, 4), "backward_until_state_grad_s": backward,
            "backward_after_first_state_s": round(b1 - prev, 4)}


def substep_times(draft, batch, stage, chunk: int = 1024) -> dict[str, Any]:
    """A stage whose sub-steps are back-propagated one by one (early, late, align), phase by phase: the batch's
    prepared targets, then each sub-step's forward (draft + fused head loss) and its backward."""
    from specdraft.objectives import prepare_targets, substeps, unwrap

    forward, backward = [], []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        t0 = time.perf_counter()
        targets = prepare_targets(unwrap(draft), batch, stage.loss, chunk)
        prepare = time.perf_counter() - t0
        steps = substeps(draft, batch, stage, generator=torch.Generator().manual_seed(0), targets=targets,
                         chunk=chunk)
        for _ in range(stage.num_substeps):
            t0 = time.perf_counter()
            sub = next(steps)
            t1 = time.perf_counter()
            (sub.weight * sub.loss).backward()
            forward.append(round(t1 - t0, 4))
            backward.append(round(time.perf_counter() - t1, 4))
    draft.zero_grad(set_to_none=True)
    return {"prepare_targets_s": round(prepare, 4), "forward_s": forward, "backward_s": backward}


def profile(draft, batch, stage, chunk: int = 1024, rows: int = 25) -> str:
    """torch.profiler's table of one step's most expensive operators (self CPU time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad])
    with prof(activities=[ProfilerActivity.CPU]) as p:
        step(draft, optimizer, batch, stage, chunk)
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def measure(args) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    setups = {}
    for recipe in args.recipes:
        draft, stages = build(recipe, args.draft_vocab)
        stages = [replace(s, noise_std=0.0) for s in stages]
        optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
        batch = batch_of(draft, args.batch, args.seq)
        for stage in stages:
            step(draft, optimizer, batch, stage, args.chunk)  # warm
        setups[recipe] = (draft, stages, optimizer, batch)
    positions = args.batch * args.seq
    times: dict[str, list[list[float]]] = {r: [] for r in args.recipes}
    cpu: dict[str, list[list[float]]] = {r: [] for r in args.recipes}
    gflops: list[float] = []
    # the matmul: specdraft.limits' CPU shape, (2048, 576, 1536), SmolLM2's MLP
    with LoadSampler(every=1.0) as load:
        for _ in range(args.rounds):
            gflops.append(measure_matmul("cpu", "bfloat16", args.threads, seconds=args.matmul_s).flops / 1e9)
            for recipe, (draft, stages, optimizer, batch) in setups.items():
                times[recipe].append([])
                cpu[recipe].append([])
                for s in stages:
                    times[recipe][-1].append(step(draft, optimizer, batch, s, args.chunk))
                    cpu[recipe][-1].append(step.cpu)
        phases = {r: [substep_times(d, b, s, args.chunk) for s in st if s.kind != "ttt"]
                  for r, (d, st, _, b) in setups.items()}
        ttt = {}
        if "eagle3" in setups:
            draft, stages, _, batch = setups["eagle3"]
            ttt = ttt_steps(draft, batch, stages[0], args.chunk)
    out: dict[str, Any] = {}
    for recipe, (draft, stages, _, _) in setups.items():
        rows = []
        for i, stage in enumerate(stages):
            fl = flops_per_position(draft, unrolled_of(stage))
            per_round = [positions / r[i] for r in times[recipe]]
            ratios = [rate / (g * 1e9 / fl["flops"]) for rate, g in zip(per_round, gflops)]
            rows.append({"kind": stage.kind, "steps": stage.steps, **fl,
                         "step_s": round(statistics.median(r[i] for r in times[recipe]), 3),
                         "step_cpu_s": round(statistics.median(r[i] for r in cpu[recipe]), 3),
                         "tokens_per_s": round(statistics.median(per_round), 1),
                         "limit_tokens_per_s": round(statistics.median(g * 1e9 / fl["flops"] for g in gflops), 1),
                         "ratio": round(statistics.median(ratios), 3)})
        mean_s = [statistics.mean(r) for r in times[recipe]]
        limit_s = [statistics.mean(positions * x["flops"] / (g * 1e9) for x in rows) for g in gflops]  # per round
        for row, times_of in zip(rows, phases[recipe]):
            row["substeps"] = times_of
        out[recipe] = {"stages": rows, "tokens_per_s": round(statistics.median(positions / s for s in mean_s), 1),
                       "ratio": round(statistics.median(lim / s for lim, s in zip(limit_s, mean_s)), 3)}
    if "eagle3" in out and "beagle3" in out:
        out["eagle3"]["over_beagle3"] = round(out["eagle3"]["tokens_per_s"] / out["beagle3"]["tokens_per_s"], 3)
        out["eagle3"]["ttt_steps"] = ttt
    if args.profile:
        for recipe in args.profile:
            draft, stages, _, batch = setups[recipe]
            out[recipe]["profile"] = {s.kind: profile(draft, batch, s, args.chunk) for s in stages}
    return {"benchmark": "train_rate", "shape": {**SMOLLM2, "draft_vocab": args.draft_vocab, "seq": args.seq,
                                                  "batch": args.batch, "loss_chunk": args.chunk,
                                                  "dtype": "bf16 autocast"},
            "matmul_gflops_bf16": [round(g, 1) for g in gflops], "recipes": out,
            "host": {"threads": args.threads, "load": load.summary()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024, help="rows per output-head chunk (train.loss_chunk)")
    parser.add_argument("--matmul-s", type=float, default=1.0, help="seconds of matmul per round")
    parser.add_argument("--profile", nargs="*", default=[], choices=list(RECIPES),
                        help="recipes whose one step is profiled (operator table in the JSON)")
    args = parser.parse_args(argv)
    result = measure(args)
    path = write_result(args.out, result)
    for recipe, row in result["recipes"].items():
        print(recipe, row["tokens_per_s"], [(s["kind"], s["tokens_per_s"], s["ratio"]) for s in row["stages"]],
              row.get("over_beagle3", ""), flush=True)
        for kind, table in row.get("profile", {}).items():
            print(kind, table, flush=True)
    if "ttt_steps" in result["recipes"].get("eagle3", {}):
        print("ttt", result["recipes"]["eagle3"]["ttt_steps"])
    print(path, result["host"]["load"], result["matmul_gflops_bf16"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
