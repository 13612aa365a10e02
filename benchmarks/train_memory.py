"""Peak memory and time of one training step per recipe at real-model shapes (issue: training at scale).

One training batch (forward + backward of every sub-step, no optimizer step) of each recipe's
stage on a draft with Llama-3-8B geometry — d=4096, 32 heads / 8 KV heads of 128, MLP 14336,
vocabulary 128,256 — over one sequence of T=2048 tokens, random weights and features. Each
measurement runs in its own process so peaks do not mix:

* ``peak_mb``: CPU — the process's peak RSS growth over the step (``/proc/self/status`` VmHWM after a
  ``clear_refs`` reset, from the RSS once the draft,
  the frozen heads and the batch exist); CUDA — ``max_memory_allocated`` growth over the step;
* ``step_s``: wall time of the step (CPU: one step, no warm-up; CUDA: the second of two steps);
* ``baseline_mb``: in another process, the peak for the draft's forward activations with
  gradients plus its weights (a plain forward + backward of the draft body without the output
  head), so ``peak / baseline`` tells how much the losses and the stage's sub-steps add;
* ``--malloc-mmap-threshold BYTES`` (CPU): glibc serves blocks from that size up with their own
  mappings and returns them on free (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` in the
  measuring processes). By default glibc raises its threshold up to 32 MB as large blocks are
  freed and keeps freed blocks below it cached, so the RSS peak also counts freed memory (TTT
  k=7 at d=4096, T=2048 bf16: the default peak is 1.25x the one measured with 131072, 1.41x
  with recompute); 131072 makes the RSS follow the live tensors (for a few per cent of step time);
* ``--loss materialized`` swaps the fused chunked head (``losses.head_loss``) for the previous
  formulation — full (tokens x vocab) fp32 logits, log-softmax, and the target's logits
  recomputed at every sub-step — to measure what the fused loss saves, in the same run.

Recipes: eagle (plain), hass (align n=3), beagle early (k=5), beagle late (s=1, 4, 8), eagle3
(training-time test k=7, aux features 3·d, draft vocabulary 32,000; also with ``recompute``:
activation checkpointing of each sub-step's decoder layer), dflash ("DFlash: Block Diffusion for Flash
Speculative Decoding" §4.2: the block stage, blocks of 16 from 512 anchors per sequence — 8,192 block
positions for T=2048 —, aux features 3·d, the target's head; ``--dflash-layers`` decoder layers, default 1:
the paper's 5 hold 5x the weights and activations, more than this host's memory; its baseline is the
draft body's forward + backward on the same blocks).

    python -m benchmarks.train_memory OUT.json [--device cpu] [--dtype bf16] [--seq 2048] [--d 4096]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.host import write_result
from specdraft.configs.stages import StageConfig
from specdraft.configs.recipes import RECIPES as PRODUCT_RECIPES

RSS_RESET = False  # whether the CPU peak is the reset high-water mark (VmHWM) rather than lifetime growth


def geometry(d: int) -> dict[str, int]:
    """Llama-3 proportions: heads of 128, 4 query heads per KV head, MLP 3.5 d (d=4096: 32/8 heads, 14336)."""
    heads = max(1, d // 128)
    return dict(num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128,
                intermediate_size=int(3.5 * d))
def stage_of(recipe: str, index: int = 0, **changes: Any) -> tuple[str, StageConfig]:
    """(architecture, stage ``index``) of ``recipe`` in the product's recipe table, with ``changes``."""
    product = PRODUCT_RECIPES[recipe]
    return product.arch, replace(product.stages[index], **changes)


# Each row one stage of the product's recipes (``specdraft.configs.recipes``: window 5, steps 4, HASS n=3, TTT k=7 with
# step decay 0.8, DFlash 512 anchors with exp(-(k-1)/7)), a few with one setting changed; measure() sets its noise
# and loss weights.
RECIPES: dict[str, tuple[str, StageConfig]] = {
    "eagle": stage_of("eagle"),
    "hass-n3": stage_of("hass"),
    "beagle-early-k5": stage_of("beagle", 0),
    "beagle-late-s1": stage_of("beagle", 1, steps=1),
    "beagle-late-s4": stage_of("beagle", 1),
    "beagle-late-s8": stage_of("beagle", 1, steps=8),
    "eagle3-ttt-k7": stage_of("eagle3"),
    # the same with each sub-step's decoder layer recomputed in the backward (train.recompute=true)
    "eagle3-ttt-k7-recompute": stage_of("eagle3", recompute=True),
    # DFlash: one forward over 512 blocks of 16 (anchors drawn per sequence)
    "dflash-b16-a512": stage_of("dflash"),
    "dflash-b16-a128": stage_of("dflash", anchors=128),
    # how TTT memory grows with k (not run by default)
    "eagle3-ttt-k1": stage_of("eagle3", steps=1),
    "eagle3-ttt-k3": stage_of("eagle3", steps=3),
}
DEFAULT_RECIPES = ["eagle", "hass-n3", "beagle-early-k5", "beagle-late-s1", "beagle-late-s4", "beagle-late-s8",
                   "eagle3-ttt-k7", "eagle3-ttt-k7-recompute", "dflash-b16-a512"]


def _status_mb(field: str) -> float:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if RSS_RESET:
        return _status_mb("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _reset_peak(device: torch.device) -> float:
    """Start a peak measurement; returns the memory in use now (the peak is measured as growth from it)."""
    global RSS_RESET
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:  # Linux: clear_refs 5 resets the RSS high-water mark to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
        RSS_RESET = True
        return _status_mb("VmRSS")
    except OSError:  # refused: growth of the process-lifetime peak (under-reports if setup peaked higher)
        RSS_RESET = False
        return _peak_mb(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def materialized_score(core, batch, targets, query_index, h_hat, weights, chunk=1024, live=None,
                       defer_weight_grad=False, query_weight=None):  # noqa: ARG001 - score's signature
    """The loss as computed before the fused head: full fp32 logits of every scored row, and the
    target's logits recomputed from the stored hidden state at every sub-step."""
    from specdraft.losses import soft_ce, topk_ce

    index = query_index[None].expand(h_hat.shape[0], -1) if query_index.dim() == 1 else query_index  # (B, Q)
    t = targets.scored.shape[1]
    scored = targets.scored.gather(1, index.clamp(0, t - 1)) & (index >= 0) & (index < t)  # (B, Q)
    where = scored.nonzero(as_tuple=True)
    h = h_hat[where]  # (M, d)
    logp = torch.log_softmax(core.logits(h).float(), dim=-1)  # (M, V) fp32
    with torch.no_grad():
        target_logits = (batch.hidden[where[0], index[where]].to(core.heads.teacher_weight.dtype)
                         @ core.heads.teacher_weight.T).float()  # (M, V)
    loss = weights.ce * soft_ce(logp, target_logits).mean()
    if weights.topk:
        top = torch.log_softmax(target_logits, -1).topk(weights.topk_k, dim=-1)
        loss = loss + weights.topk * topk_ce(logp, top.indices, top.values).mean()
    correct = torch.zeros_like(scored)
    return loss, {}, correct, scored, scored


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One (recipe, loss) measurement; runs in a fresh process."""
    torch.set_num_threads(spec["threads"])
    import specdraft.objectives as objectives
    from specdraft.batch import Batch
    from specdraft.configs.draft import DEFAULT_BLOCK_SIZE, DraftConfig
    from specdraft.models import build_draft, set_frozen_dtype
    from specdraft.objectives import train_batch
    from specdraft.configs.stages import LossWeights

    device = torch.device(spec["device"])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[spec["dtype"]]
    arch, stage = RECIPES[spec["recipe"]]
    d, vocab, t = spec["d"], spec["vocab"], spec["seq"]
    e3, block = arch == "eagle3", arch == "dflash"
    g = torch.Generator().manual_seed(0)
    blocks = dict(num_layers=spec["dflash_layers"], block_size=DEFAULT_BLOCK_SIZE, mask_token_id=0) if block else {}
    cfg = DraftConfig(arch=arch, vocab_size=vocab, hidden_size=d, **geometry(d),
                      aux_layers=[2, 16, 29] if e3 or block else [],
                      draft_vocab_size=spec["draft_vocab"] if e3 else None, max_position_embeddings=8192, **blocks)
    vocab_ids = torch.randperm(vocab, generator=g)[: spec["draft_vocab"]].sort().values if e3 else None
    embed = (torch.randn(vocab, d, generator=g) * 0.02).to(dtype)
    lm_head = (torch.randn(vocab, d, generator=g) * 0.02).to(dtype)
    draft = build_draft(cfg, embed, lm_head, vocab=vocab_ids).to(device)  # fp32 master weights
    set_frozen_dtype(draft, dtype)
    del embed, lm_head
    weights = LossWeights(ce=1.0, topk=1.0 if spec["recipe"].startswith("hass") else 0.0,
                          vloss=0.0 if e3 or block else 1.0)
    stage = replace(stage, noise_std=0.0, loss=weights)
    ids = torch.randint(vocab, (spec["batch"], t), generator=g)
    hidden = torch.randn(spec["batch"], t, d, generator=g).to(torch.float16)
    mask = torch.ones(spec["batch"], t, dtype=torch.bool)
    aux = torch.randn(spec["batch"], t, 3 * d, generator=g).to(torch.float16) if e3 or block else None
    top = torch.randn(spec["batch"], t, 10, generator=g).log_softmax(-1)
    topk_ids = torch.randint(vocab, (spec["batch"], t, 10), generator=g)
    batch = Batch(ids, hidden, mask, mask, topk_ids, top, aux).to(device)
    if spec["loss"] == "materialized":
        objectives.score = materialized_score
    autocast = (torch.autocast(device_type=device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16
                else torch.autocast(device_type=device.type, enabled=False))
    params_mb = sum(p.numel() * p.element_size() for p in draft.parameters()) / 2**20
    frozen_mb = sum(b.numel() * b.element_size() for b in draft.heads.buffers()) / 2**20

    if spec["part"] == "baseline":  # the draft body's forward activations (with gradients) + backward, no head
        base0 = _reset_peak(device)
        with autocast:
            st_q = torch.arange(t, device=device)
            features = (batch.aux_hidden if e3 or block else batch.hidden).to(torch.float32)
            if block:  # the same number of blocks as the step draws
                from specdraft.masks import sample_blocks

                anchors = sample_blocks(batch.loss_mask & (batch.positions > 0), 16, stage.anchors).anchors
                h = draft(batch.input_ids, batch.positions, features, anchors)
            else:
                h = draft(batch.input_ids, batch.positions, features, st_q, st_q,
                          features.new_zeros(spec["batch"], t, 0, d))
            h.float().square().mean().backward()
        _sync(device)
        return {"baseline_mb": round(_peak_mb(device) - base0 + params_mb, 1)}

    steps = 2 if device.type == "cuda" else 1
    step_s = 0.0
    for i in range(steps):
        draft.zero_grad(set_to_none=True)
        start_mb = _reset_peak(device)
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            metrics = train_batch(draft, batch, stage, offset=0, chunk=spec["chunk"])
        _sync(device)
        step_s = time.perf_counter() - t0
        peak = _peak_mb(device) - start_mb
    return {**spec, "step_s": round(step_s, 3), "tokens_per_s": round(spec["batch"] * t / step_s, 1),
            "peak_mb": round(peak, 1),
            **({"block_positions": spec["batch"] * min(stage.anchors, t - 1) * 16} if block else {}),
            "draft_params_mb": round(params_mb, 1), "frozen_heads_mb": round(frozen_mb, 1),
            "loss": spec["loss"], "loss_value": round(metrics["loss"], 4), "substeps": stage.num_substeps,
            "peak_note": ("max_memory_allocated growth" if device.type == "cuda" else
                          "RSS high-water mark growth after a clear_refs reset (includes allocator caching)"
                          if RSS_RESET else "lifetime ru_maxrss growth (reset refused: under-reports)")}


def _worker(spec: dict[str, Any], queue) -> None:
    try:
        queue.put(measure(spec))
    except Exception as err:  # noqa: BLE001 - report the failure (e.g. out of memory) as a result row
        queue.put({**spec, "error": f"{type(err).__name__}: {err}"})


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """The step and the baseline, each in a fresh process (CPU peaks cannot be reset)."""
    ctx = mp.get_context("spawn")
    out = {}
    for part in ("step", "baseline"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_worker, args=({**spec, "part": part}, queue))
        proc.start()
        out.update(queue.get())
        proc.join()
    out.pop("part", None)
    if "error" not in out and out.get("baseline_mb"):
        out["peak_over_baseline"] = round(out["peak_mb"] / out["baseline_mb"], 3)
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals of the issue, computed from rows of one run."""
    by = {(r["recipe"], r["loss"]): r for r in rows if "error" not in r}
    out: dict[str, Any] = {}

    def ratio(a, b, key):
        if a in by and b in by and by[b][key]:
            return round(by[a][key] / by[b][key], 3)
        return None

    for loss in ("fused", "materialized"):
        out[loss] = {
            "late_s4_over_early_time": ratio(("beagle-late-s4", loss), ("beagle-early-k5", loss), "step_s"),
            "late_s8_over_s4_time": ratio(("beagle-late-s8", loss), ("beagle-late-s4", loss), "step_s"),
            "late_s8_over_hass3_time": ratio(("beagle-late-s8", loss), ("hass-n3", loss), "step_s"),
            "late_s8_over_s1_peak": ratio(("beagle-late-s8", loss), ("beagle-late-s1", loss), "peak_mb"),
            "max_peak_over_baseline": max((r["peak_over_baseline"] for (rec, lo), r in by.items()
                                           if lo == loss and r["peak_over_baseline"]), default=None),
            "ttt_k7_recompute_over_ttt_k7_peak": ratio(("eagle3-ttt-k7-recompute", loss), ("eagle3-ttt-k7", loss),
                                                       "peak_mb"),
            "ttt_k7_recompute_over_ttt_k7_time": ratio(("eagle3-ttt-k7-recompute", loss), ("eagle3-ttt-k7", loss),
                                                       "step_s"),
        }
    out["materialized_over_fused_peak"] = {rec: ratio((rec, "materialized"), (rec, "fused"), "peak_mb")
                                           for rec in RECIPES}
    return out


def compared(row: dict[str, Any], earlier: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``row``'s peak and rate over those of the first row of the same (recipe, loss) in the ``earlier`` results
    (file name -> result)."""
    same = [(name, result, r) for name, result in earlier.items() for r in result["rows"]
            if (r["recipe"], r["loss"]) == (row["recipe"], row["loss"]) and "error" not in r]
    if not same or "error" in row:
        return {}
    name, result, other = same[0]
    rate = other.get("tokens_per_s") or round(other["batch"] * other["seq"] / other["step_s"], 1)
    device = (result.get("host") or result["machine"])["device"]  # results written before write_result: "machine"
    return {"compared": {"file": name, "device": device, "peak_mb": other["peak_mb"],
                         "tokens_per_s": rate, "peak_over_compared": round(row["peak_mb"] / other["peak_mb"], 3),
                         "speedup_over_compared": round(row["tokens_per_s"] / rate, 1)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=1024, help="rows per output-head chunk")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dflash-layers", type=int, default=1, help="decoder layers of the dflash rows")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None,
                        help="CPU: glibc mmap/trim threshold in the measuring processes (RSS follows live memory)")
    parser.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES, choices=list(RECIPES))
    parser.add_argument("--loss", nargs="+", default=["fused", "materialized"], choices=("fused", "materialized"))
    parser.add_argument("--compare", type=Path, nargs="+", default=[],
                        help="earlier results (e.g. the CPU runs at the same shape): the first one's row of the same "
                             "recipe and loss, its peak and rate beside ours")
    args = parser.parse_args(argv)
    if args.malloc_mmap_threshold is not None:  # read by glibc when the spawned measuring processes start
        os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ["MALLOC_TRIM_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    earlier = {path.name: json.loads(path.read_text()) for path in args.compare}
    rows = []
    for loss in args.loss:
        for recipe in args.recipes:
            spec = dict(recipe=recipe, loss=loss, device=args.device, dtype=args.dtype, d=args.d, vocab=args.vocab,
                        draft_vocab=args.draft_vocab, seq=args.seq, batch=args.batch, chunk=args.chunk,
                        threads=args.threads, dflash_layers=args.dflash_layers)
            row = run(spec)
            rows.append(row)
            row.update(compared(row, earlier))
            shown = {k: row.get(k) for k in ("recipe", "loss", "step_s", "peak_mb", "baseline_mb", "error")}
            print(json.dumps(shown), flush=True)
    result = {
        "benchmark": "train_memory",
        "host": {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                 "threads": args.threads, "malloc_mmap_threshold": args.malloc_mmap_threshold},  # and write_result's
        "shapes": {"d": args.d, "vocab": args.vocab, "draft_vocab": args.draft_vocab, "seq": args.seq,
                   "batch": args.batch, "dtype": args.dtype, **geometry(args.d)},
        "rows": rows,
        "ratios": ratios(rows),
    }
    write_result(args.out, result)
    print(json.dumps(result["ratios"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
