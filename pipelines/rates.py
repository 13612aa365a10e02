"""Each throughput stage's rate beside the machine's limit, for the run summary and the report (issue 41, item 4;
docs/first-run.md "What a run says", the rates). The limit itself — FLOPs per token, the matmul measured in this
run, the ratio — is ``specdraft.limits``; this module says, per stage, what its tokens are, which setting it ran
at, and what the FLOPs per token count.

While a run goes: ``start_run`` opens the run's ``rates.json`` (``specdraft.limits.RunReferences``; an earlier
run's is replaced), the flow's stage wrapper samples the load average during each stage and hands it to
``after_stage``, which measures the matmul at the stage's device, dtype and threads in the shape of the target's
MLP (once per run for each) and records the stage's tokens and FLOPs per token. At the end ``read_run`` returns the file (the flow keeps it as
``result["rates"]``) and ``rate_lines`` turns it into one line per stage for ``pipelines.summary``:

* regenerate: the tokens the target generated (prompt tokens not counted: a prefill is cheaper per token than
  decoding, so the limit is the rate of a decode that is compute-bound), ``2 x`` the target's matmul parameters;
* features (the dump): the tokens written this run, ``2 x`` the target's matmul parameters (one forward each);
* train: the tokens the training loop counted over every epoch — the positions it trained when it counts them
  (``metrics.state_positions``), else its loss tokens (``metrics.state_tokens``: the draft also runs on the
  positions without loss, so this rate is a floor) — ``6 x`` the draft's matmul parameters ``x`` its sub-steps
  per step (the mean over metrics.jsonl's steps of the ``loss_step<i>`` a step logged: 1 for a one-step stage, k
  for a training-time test over k steps); a training resumed from an earlier try's checkpoint counts the share
  of the tokens its steps logged in this run.

A skipped stage (finished by an earlier run) shows no rate: its time is that run's.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.configs import RunConfig
from pipelines.records import Dumped, Regenerated, Trained
from specdraft import limits

RATE_STAGES = ("regenerate", "features", "train")


def start_run(workdir: str | Path) -> str:
    """Open this run's ``rates.json`` (whatever an earlier run left is replaced); its id for ``after_stage``."""
    return limits.RunReferences.start(workdir).run


def read_run(workdir: str | Path, run: str) -> dict[str, Any]:
    """This run's references and stages (nothing of another run's file)."""
    return limits.RunReferences(workdir, run).read()


def _threads(n: float | None) -> int:
    return max(1, min(int(n or os.cpu_count() or 1), os.cpu_count() or 1))


def stage_setting(cfg: RunConfig, stage: str, record: Any) -> tuple[str, str, int]:
    """(device, dtype, threads) ``stage`` computed at: its record's ``summary`` when it says (``device``,
    ``dtype``, ``threads``), else the run's settings; threads of every replica together, at most the CPUs."""
    from specdraft.placement import dtype_name, resolve_device, resolve_dtype

    said = getattr(record, "summary", {}) or {}
    if stage == "train":
        scaling = cfg.train.scaling
        device = "cuda" if scaling.use_gpu else "cpu"
        precision = cfg.train.precision if cfg.train.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
        dtype = "bfloat16" if precision == "bf16" else "float32"
        per = scaling.cpu_threads()
        threads = _threads(per * scaling.num_workers if per else None)
    else:
        device = resolve_device("auto").type
        if stage == "regenerate":
            dtype, threads = cfg.regenerate.dtype, cfg.regenerate.num_cpus * cfg.regenerate.concurrency
        else:
            f = cfg.features
            dtype, threads = f.dtype, (f.torch_threads or f.cpus_per_actor) * f.num_actors
        threads = _threads(threads)
    device = said.get("device", device)
    dtype = dtype_name(resolve_dtype(said.get("dtype", dtype), device))  # a record's "auto" as the stage resolved it
    return device, dtype, int(said.get("threads", threads))


def logged_steps(metrics_file: str | Path, since: float = 0.0) -> tuple[float, int, int]:
    """Over metrics.jsonl's training steps: the mean sub-steps per step (its ``loss_step<i>`` keys), the steps read,
    and how many of them were logged at or after ``since`` (a time.time(): this run's, when training resumed from a
    checkpoint an earlier try left)."""
    counts, now = [], 0
    path = Path(metrics_file)
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line) if line.strip() else {}
        if row.get("kind") == "metrics" and "loss" in row:
            counts.append(sum(1 for k in row if k.startswith("loss_step")) or 1)
            now += row.get("time", since) >= since
    return (sum(counts) / len(counts) if counts else 1.0), len(counts), now


def stage_work(stage: str, record: Any, target: str, started: float = 0.0) -> tuple[int, float, str]:
    """(tokens, FLOPs per token, what they count) of a stage finished now that started at ``started``
    (time.time())."""
    if stage == "train":
        params = limits.matmul_parameters(record.draft)
        unroll, steps, now = logged_steps(record.metrics_file, started)
        # the positions the draft ran on when the loop counts them, else its loss tokens (a floor of the positions)
        counted = "state_positions" if "state_positions" in record.metrics else "state_tokens"
        tokens = int(record.metrics.get(counted, 0))
        said = ("position trained" if counted == "state_positions"
                else "loss token trained (positions without loss not counted)")
        if steps and now < steps:  # resumed: the steps an earlier try ran are not this run's time
            tokens = round(tokens * now / steps)
            said += f"; resumed: {now} of {steps} steps ran now, their share of the tokens counted"
        return (tokens, limits.train_flops(params, unroll),
                f"6 x {params / 1e6:.2f}M draft matmul params x {unroll:.2f} sub-steps (mean of {steps} steps) per "
                + said)
    params = limits.matmul_parameters(target)
    if stage == "regenerate":
        tokens, what = record.summary.get("tokens_generated", 0), "generated token (prompt tokens not counted)"
    else:
        tokens, what = record.summary.get("tokens_written", record.summary.get("tokens", 0)), "token dumped"
    return int(tokens), limits.forward_flops(params), f"2 x {params / 1e6:.2f}M target matmul params per {what}"


def record_key(stage: str, record: Any) -> str:
    """The stage's entry in ``rates.json``: ``<stage>/<record key>`` (one per prompt file for regenerate, features)."""
    return f"{stage}/{record.key}"


def after_stage(cfg: RunConfig, run: str, stage: str, record: Any, target: str, load: dict[str, Any]) -> None:
    """Record a stage that ran now: its tokens, FLOPs per token, the load during it (``limits.LoadSampler.summary``)
    and this run's matmul at its setting (measured now when the run has none at that setting yet)."""
    if stage not in RATE_STAGES or getattr(record, "skipped", False):
        return
    refs = limits.RunReferences(cfg.workdir, run)
    tokens, flops_per_token, counted = stage_work(stage, record, target, time.time() - record.wall_s)
    device, dtype, threads = stage_setting(cfg, stage, record)
    reference = refs.matmul(device, dtype, threads, limits.mlp_shape(target, device))
    refs.record_stage(record_key(stage, record), {
        "tokens": tokens, "flops_per_token": flops_per_token, "counted": counted, "reference": reference.key,
        "load_1m": load.get("load_1m_mean"), "load_1m_max": load.get("load_1m_max")})


@dataclass(frozen=True, kw_only=True, slots=True)
class RateLine:
    stage: str
    note: str  # the prompt file of a per-file stage
    rate: limits.StageRate | None  # None: skipped, or not measured (``why``)
    why: str = ""


def rate_lines(result: dict[str, Any]) -> list[RateLine]:
    """One line per throughput stage of the run (per prompt file for regenerate and features) from the flow's
    records and ``result["rates"]`` (``read_run``; none: no rates measured)."""
    rates = result.get("rates") or {}
    stages, references = rates.get("stages", {}), rates.get("matmul", {})
    records: list[tuple[str, Any, str]] = []
    for r in map(Regenerated.from_dict, result["regenerate"]):
        records.append(("regenerate", r, r.prompt.rsplit("/", 1)[-1]))
    for d, r in zip(map(Dumped.from_dict, result["features"]), result["regenerate"]):
        records.append(("features", d, r["prompt"].rsplit("/", 1)[-1]))
    records.append(("train", Trained.from_dict(result["train"]), ""))
    out = []
    for stage, record, note in records:
        if record.skipped:
            out.append(RateLine(stage=stage, note=note, rate=None, why="skipped: done by an earlier run (its time "
                                                                        "is that run's, no rate)"))
            continue
        entry = stages.get(record_key(stage, record))
        rate = limits.stage_rate(entry, references, record.wall_s) if entry else None
        why = "" if rate else ("no tokens" if entry and not entry.get("tokens") else "limit not measured in this run")
        out.append(RateLine(stage=stage, note=note, rate=rate, why=why))
    return out


def _n(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def rate_text(lines: list[RateLine], width: int) -> list[str]:
    """The rates as text, under the stage table: a table (tokens, wall s, tokens/s, limit tokens/s, ratio, load),
    then how each limit was computed, one line per stage wrapped at ``width``."""
    import textwrap

    if not lines:
        return []
    out = [f"{'rate':<12} {'tokens':>9} {'wall s':>8} {'tokens/s':>9} {'limit/s':>9} {'ratio':>6} {'load':>5}"
               "   (limit/s: this run's matmul FLOP/s over FLOPs per token; load: during the stage)"]
    for line in lines:
        r = line.rate
        if r is None:
            out.append(f"{line.stage:<12} {line.why}" + (f"  {line.note}" if line.note else ""))
            continue
        out.append(f"{line.stage:<12} {r.tokens:>9} {r.wall_s:>8.1f} {r.tokens_per_s:>9.1f} "
                   f"{r.limit_tokens_per_s:>9.1f} {r.ratio:>6.3f} {_n(r.load_1m, '5.2f'):>5}"
                   + (f"  {line.note}" if line.note else ""))
    for line in lines:
        if line.rate is not None:
            out.append(textwrap.fill(line.rate.how, width, initial_indent=f"limit {line.stage}: ",
                                     subsequent_indent=" " * 6))
    return out
