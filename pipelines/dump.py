"""Dump stage: the target's per-token features into a sharded Zarr v3 store — the Ray Data adapter.

The feature format ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", §3, for the auxiliary layers) is ``specdraft.features``'; the shard plan, resume
and shard records are ``specdraft.store``'s. This module only runs them on Ray Data, one row per *shard*:

    plan (driver)            an existing store in ``out`` checked against the target (its recorded
                             fingerprint, ``store.manifest.check_store_target``), then ``store.plan_shards``
                             + ``features.store_header`` (aux layers resolved once, here); complete
                             shards already on disk are kept (``resume_shards``)
    -> tokenize_shard        ``chat.tokenize_conversations`` of the shard's rows (tasks); over-long,
                             unrenderable and loss-free rows are counted, never silently dropped
    -> PrefillActor          ``features.sequence_features`` (the target prefill in padded, length-grouped
                             batches; ``gpus_per_actor`` GPUs per actor on a GPU cluster, the target
                             spread over them) -> ``features.encode_features`` (the stored arrays)
    -> ZarrShardDatasink     one ``store.write_shard`` per row: one writer per shard, temp dir + rename
                             (at an ``s3://``/fsspec URL: in place, the shard record last);
                             ``on_write_complete`` writes ``manifest.json`` last (driver)

A shard's rows never split across blocks, so every shard has exactly one writer; its content
depends only on its planned sample ids, so a rerun redoes only missing shards and no sample
is written twice.

Rows the dump never sees are counted too: prompts read through ingest (``load_prompts``) have their
rejected rows and skipped files written to the store's ``rejects.jsonl`` (once the store is known
to be this dump's), and the ingest summary goes into the dump's summary, written as the store's
``summary.json``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import transformers
from ray.data import ActorPoolStrategy, Datasink

from pipelines.cluster import ACTOR_POOL, connect_ray
from pipelines.configs import DumpConfig, for_dump
from pipelines.ingest import load_conversations, write_rejects
from pipelines.nodes import by_node, this_node
from specdraft import store
from specdraft.progress import ProgressLines
from specdraft.chat import tokenize_conversations
from specdraft.features import encode_features, nonfinite_tokens, sequence_features, store_header
from specdraft.configs.features import FeaturesConfig
from specdraft.targets import Target
from specdraft.targets.checkpoint import weight_files
from specdraft.placement import describe_placement, resolve_dtype
from specdraft.configs.devices import spread_gpus
from specdraft.store import location
from specdraft.store.manifest import check_store_target
from specdraft.targets.loading import load_target_config, load_target_model, load_tokenizer


PROGRESS_EVERY_S = 30.0  # a progress line at most this often while shards finish (and at the first and last)
REJECTS_FILE = "rejects.jsonl"  # ingest's rejected rows and skipped files, in the store
PROCESS_BYTES = 3 << 28  # 0.75 GiB: a prefill actor's process before the target (torch, transformers, Ray's worker)
SUMMARY_FILE = "summary.json"  # the dump's summary (with the ingest summary), in the store


def load_prompts(paths: list[str | Path]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The conversations of ``paths`` for a dump (``ingest.load_conversations``) and the ingest summary
    with its reject records (None: all conversation Parquet, nothing ingested), for
    ``dump_features(ingested=...)``, which writes them into the store."""
    return load_conversations(paths, keep_rejects=True)


class InjectedFault(RuntimeError):
    """Raised by the ``fault_at_shard`` test hook: a writer dying mid-shard."""


_TOKENIZERS: dict[str, Any] = {}


def tokenize_shard(batch: dict[str, np.ndarray], target: Target, cfg: FeaturesConfig) -> dict[str, np.ndarray]:
    """One shard row -> concatenated ``input_ids``/``loss_mask``, ``offsets`` and a JSON ``meta``."""
    assert len(batch["index"]) == 1, "tokenize_shard takes one shard per batch"
    if target not in _TOKENIZERS:
        _TOKENIZERS[target] = load_tokenizer(target, trust_remote_code=cfg.trust_remote_code)
    t0, c0 = time.perf_counter(), time.process_time()
    data = tokenize_conversations(_TOKENIZERS[target], json.loads(str(batch["samples"][0])), cfg.max_length,
                                  cfg.overlong)
    input_ids, loss_mask, offsets = data.concatenated()  # (N,), (N,), (S+1,)
    meta = {"index": int(batch["index"][0]), "plan_digest": str(batch["plan_digest"][0]),
            "sample_ids": data.sample_ids, "rejected": data.rejected, "rejected_examples": data.rejected_examples,
            "truncated": data.truncated,
            "timings": {"tokenize_s": time.perf_counter() - t0, "tokenize_cpu_s": time.process_time() - c0}}
    return {"index": batch["index"], "input_ids": np.asarray([input_ids]), "loss_mask": np.asarray([loss_mask]),
            "offsets": np.asarray([offsets]), "meta": np.asarray([json.dumps(meta)])}  # (1, ...)


def parameter_count(target: Target | str | Path) -> int:
    """The target's parameters, from its safetensors headers (shapes only: no tensor is read)."""
    count = 0
    for file in weight_files(Target.of(target).path):
        with open(file, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        count += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return count


def actor_memory(target: Target, cfg: DumpConfig, use_gpu: bool) -> int:
    """The memory (bytes) a ``PrefillActor`` asks Ray for: its process (``PROCESS_BYTES``) and, on CPU, the target's
    weights at the inference dtype plus one prefill batch's peak — ``cfg.batch_tokens`` positions of the decoder's
    states (every layer's when auxiliary layers are stored) in that dtype, and one ``logits_chunk`` block of logits
    (chunk, V) in that dtype and its float32 copy (``features.prefill_features``: the lm_head runs on the valid
    rows, a chunk at a time). On GPU the weights and the batch are GPU memory, which Ray's ``num_gpus`` accounts
    for. SmolLM2-135M, fp32, EAGLE-3 layers, 8,192-token batches: 0.75 + 0.50 (weights) + 0.55 (31 layers'
    states) + 0.75 (2,048 x 49,152 logits, twice) = 2.6 GiB."""
    if use_gpu:
        return PROCESS_BYTES
    width = torch.finfo(resolve_dtype(cfg.dtype, "cpu")).bits // 8
    config = load_target_config(target, cfg.trust_remote_code)
    text = getattr(config, "text_config", None) or config
    layers = text.num_hidden_layers + 1 if cfg.aux_layers else 2
    chunk = min(cfg.logits_chunk, cfg.batch_tokens) * text.vocab_size  # (chunk, V)
    return PROCESS_BYTES + (parameter_count(target) + cfg.batch_tokens * layers * text.hidden_size + chunk) * width \
        + 4 * chunk


class PrefillActor:
    """A target replica: shard rows of tokens in, shard rows of stored feature arrays out."""

    def __init__(self, target: Target, cfg: DumpConfig, aux_layers: list[int], use_gpu: bool) -> None:
        self.cfg, self.aux_layers = cfg, list(aux_layers)  # resolved by the driver (the store header's)
        transformers.utils.logging.disable_progress_bar()  # one weight-loading bar per actor is noise
        if not use_gpu:
            torch.set_num_threads(cfg.torch_threads or max(1, int(cfg.cpus_per_actor)))
        # on GPU the actor holds gpus_per_actor GPUs (Ray's request) and spreads the target over them
        self.model = load_target_model(target, cfg.dtype, "cuda" if use_gpu else "cpu",
                                       trust_remote_code=cfg.trust_remote_code,
                                       gpus=spread_gpus(cfg.gpus_per_actor) if use_gpu else 1,
                                       attn_implementation=cfg.attn_implementation)
        self.placement = describe_placement(self.model)  # recorded in every shard it writes
        self.node = this_node()  # the summary's placement: which node computed which shard
        self.pad_id = self.model.config.pad_token_id or 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert len(batch["index"]) == 1, "PrefillActor takes one shard per batch"
        started, cpu = time.perf_counter(), time.process_time()
        offsets = np.asarray(batch["offsets"][0], np.int64)
        seqs = np.split(np.asarray(batch["input_ids"][0], np.int32), offsets[1:-1]) if len(offsets) > 1 else []
        features, timings = sequence_features(self.model, seqs, self.cfg, self.aux_layers, self.pad_id)
        t0 = time.perf_counter()
        arrays = encode_features(features, self.cfg.hidden_codec, len(self.aux_layers))
        t1 = time.perf_counter()
        meta = json.loads(str(batch["meta"][0]))
        meta["nonfinite_tokens"] = nonfinite_tokens(arrays, self.cfg.hidden_codec)
        meta["placement"], meta["node"] = self.placement, self.node
        meta["timings"].update(timings, encode_s=t1 - t0, check_s=time.perf_counter() - t1,
                               actor_s=time.perf_counter() - started, actor_cpu_s=time.process_time() - cpu)
        return {**{k: np.asarray([v]) for k, v in arrays.items()}, "index": batch["index"],  # (1, ...)
                "input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"], "offsets": batch["offsets"],
                "meta": np.asarray([json.dumps(meta)])}


class ZarrShardDatasink(Datasink):
    """Writes each row (one complete shard) with ``store.write_shard``; manifest on completion."""

    def __init__(self, out: Path | str, header: dict[str, Any], cfg: FeaturesConfig, kept: list[dict[str, Any]],
                 fault_at_shard: int | None = None) -> None:
        self.out, self.header, self.cfg, self.kept = location.as_location(out), header, cfg, kept
        self.fault_at_shard = fault_at_shard
        self.written: list[dict[str, Any]] = []
        self.manifest: dict[str, Any] | None = None
        self.leftovers: list[Any] = []  # dead writers' temporary shards found at the end (``finish``)
        self.nodes: list[dict[str, Any]] = []  # the shards this run wrote, by the node that computed them

    def write(self, blocks, ctx) -> list[dict[str, Any]]:
        from ray.data.block import BlockAccessor

        return [self.write_row(row) for block in blocks
                for row in BlockAccessor.for_block(block).iter_rows(public_row_format=False)]

    def write_row(self, row: dict[str, Any]) -> dict[str, Any]:
        meta = json.loads(str(row["meta"]))
        index = int(meta["index"])
        if index == self.fault_at_shard:  # test hook: die with a half-written shard (where its writer writes)
            name = store.shard_name(index) if location.is_url(self.out) else store.temp_shard_name(index)
            group = location.open_group(location.join(self.out, name), "w")
            group.create_array("input_ids", data=np.asarray(row["input_ids"], np.int32))
            raise InjectedFault(f"injected fault while writing shard {index}")
        if (done := self.already_written(index, meta["plan_digest"])) is not None:
            return {**done, "node": meta.get("node")}
        names = [*store.TOKEN_ARRAYS, "offsets", *(n for n in ("hidden_scale", *store.AUX_ARRAYS) if n in row)]
        arrays = {name: np.asarray(row[name]) for name in names}
        arrays["sample_ids"] = np.asarray(meta["sample_ids"], dtype=str)
        t0, c0 = time.perf_counter(), time.process_time()
        record = store.write_shard(self.out, index, arrays, store.shard_attrs(self.header, meta),
                                   chunk_tokens=self.cfg.chunk_tokens, compression=self.cfg.compression,
                                   level=self.cfg.compression_level)
        # write timings reach the manifest (this run's records) but not the shard's own attributes
        record["timings"] = {**record["timings"], "write_s": round(time.perf_counter() - t0, 4),
                             "write_cpu_s": round(time.process_time() - c0, 4)}
        record["node"] = meta.get("node")  # the prefill actor's (``finish`` takes it out of the record)
        return record

    def already_written(self, index: int, plan_digest: str) -> dict[str, Any] | None:
        """The record of shard ``index`` when it is already complete with this plan: a write Ray ran again after its
        node was lost (the task's result lost with the node, the shard final already) keeps the shard, not rewrites
        it (found by ``tests/faults/test_node_loss.py``). At the start of a dump only kept shards are complete, and
        those are not written again, so this finds only this dump's own."""
        try:
            record = store.read_shard_record(location.join(self.out, store.shard_name(index)))
        except store.StoreError:
            return None
        same = (record.get("plan_digest") == plan_digest and record.get("features_hash") == self.header["features_hash"]
                and record.get("target_id") == self.header["target_id"])
        return record if same else None

    def on_write_complete(self, write_result) -> None:
        self.finish([r for returns in write_result.write_returns for r in (returns or [])])

    def finish(self, written: list[dict[str, Any]]) -> None:
        """Write ``manifest.json`` from kept + newly written shard records (driver side)."""
        placed = [(r.pop("node", None), r["index"]) for r in written]  # not a manifest field
        self.nodes = by_node({**node, "shards": [index]} for node, index in placed if node)
        self.written = written
        shards = self.kept + self.written
        missing = sorted(set(range(self.header["num_shards"])) - {r["index"] for r in shards})
        if missing:
            raise store.StoreError(f"{self.out}: shards {missing[:10]} were not written; not writing a manifest")
        # every shard is final now: a temporary left is a writer's that died mid-shard (its node lost while Ray
        # retried the shard elsewhere), of this store's own naming; removed and counted
        self.leftovers = store.list_shard_dirs(self.out)[1]
        for path in self.leftovers:
            location.remove(path)
        self.manifest = store.make_manifest(header=self.header, shards=shards)
        store.write_manifest(self.out, self.manifest)


class ShardProgress:
    """The dump's progress lines while Ray Data writes (``specdraft.progress``: ``dump 3/12 shards tok/s N eta
    Ns``): a driver-side thread polls the store every ``poll_s`` for shards finished since — what resume counts as
    done, a final shard directory whose record was written last (``read_shard_record``) — and their tokens;
    ``ProgressLines`` prints at the first, the last and at most every ``every_s`` seconds, and again after
    ``every_s`` with no new shard (so a slow shard is not silence). ``known``: the indices there before (kept)."""

    def __init__(self, out: Path | str, todo: int, known: set[int], every_s: float = PROGRESS_EVERY_S,
                 poll_s: float = 2.0, stream: Any = None) -> None:
        self.out, self.seen, self.poll_s = out, set(known), poll_s
        self.lines = ProgressLines("dump", todo, "shards", every_s=every_s, stream=stream)
        self.stop = threading.Event()
        # in the caller's context: a flow's print capture (Prefect's log_prints) takes the thread's lines too
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run,), name="dump-progress",
                                       daemon=True)

    def poll(self) -> None:
        """Count the shards finished since the last poll (one progress line when due)."""
        finals, _ = store.list_shard_dirs(self.out)
        new, tokens = 0, 0
        for index, path in sorted(finals.items()):
            if index in self.seen:
                continue
            try:
                tokens += int(store.read_shard_record(path).get("num_tokens", 0))
            except store.StoreError:  # at a URL: still being written
                continue
            self.seen.add(index)
            new += 1
        heartbeat = self.lines.printed is not None and self.lines.done < self.lines.total  # no rate before one
        if new or heartbeat:
            self.lines.update(new, tokens)

    def _run(self) -> None:
        while not self.stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a store listing that failed once (an object store's blip): next poll
                continue

    def __enter__(self) -> "ShardProgress":
        print(f"[specdraft] dump 0/{self.lines.total} shards ({len(self.seen)} already in {self.out}): starting",
              file=self.lines.stream or sys.stdout, flush=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        if exc[0] is None:
            self.poll()  # the last shards: the last line


def dump_features(
    target: Target | str | Path,
    conversations: list[dict[str, Any]],
    out: str | Path,
    cfg: FeaturesConfig | DumpConfig = DumpConfig(),
    *,
    progress: bool = True,
    lines: bool = True,
    overwrite: bool = False,
    fault_at_shard: int | None = None,
    ingested: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Dump ``conversations`` (rows ``{id, messages}``) through ``target`` into the store ``out``.

    Resumes: complete shards of the same plan are kept, the rest (re)written. Returns the summary
    (also what ``specdraft dump`` prints), written as ``out``/``summary.json`` with ``ingested`` (the
    summary of the ingest that read the conversations, ``load_prompts``) under ``ingest``; its
    reject records go to ``out``/``rejects.jsonl``.
    ``progress``: Ray Data's progress bars; ``lines``: the dump's progress lines (``ShardProgress``: shards done,
    tokens/s, ETA), which the flow prints without the bars.
    ``fault_at_shard`` is a test hook that kills the writer of that shard mid-write. A store already in
    ``out`` made from another target is refused (``TargetMismatch`` naming the store and both
    fingerprints) unless ``overwrite``, before Ray starts.
    """
    started, started_at, connect_s = time.perf_counter(), time.time(), 0.0
    cfg = for_dump(cfg)  # a core FeaturesConfig: the actors' defaults
    target, out = Target.of(target), location.as_location(out)  # the target checked here, once
    if not overwrite:
        check_store_target(out, target, legacy_mismatch="error")  # resume only a store of this target
    location.make_dirs(out)
    plan, duplicates = store.plan_shards(conversations, cfg.samples_per_shard)
    header = store_header(target, cfg, plan, len(conversations), duplicates)  # resolves aux_layers, once
    kept = store.resume_shards(out, header, plan, overwrite)
    if ingested is not None:  # the store is this dump's: record what ingest left out
        rejects = write_rejects(location.join(out, REJECTS_FILE), ingested.get("rejects", []))
        ingested = {**{k: v for k, v in ingested.items() if k != "rejects"}, "rejects_path": str(rejects)}
    done = {r["index"] for r in kept}
    todo = [row for row in plan if row["index"] not in done]
    sink = ZarrShardDatasink(out, header, cfg, kept, fault_at_shard)
    if todo:
        connect_s = time.perf_counter()
        connect_ray()  # RAY_ADDRESS, or a local cluster
        connect_s = time.perf_counter() - connect_s
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        ray.data.DataContext.get_current().enable_progress_bars = progress
        ds = ray.data.from_items(todo, override_num_blocks=len(todo))
        ds = ds.map_batches(tokenize_shard, batch_size=1, batch_format="numpy", fn_kwargs={"target": target, "cfg": cfg})
        actors = min(cfg.num_actors, len(todo))
        # what an actor uses (the estimate), never more than the cluster's share per actor: a request Ray can never
        # grant would leave the pool waiting for ever instead of failing
        memory = min(actor_memory(target, cfg, use_gpu), int(ray.cluster_resources().get("memory", 0) // actors))
        ds = ds.map_batches(
            PrefillActor, batch_size=1, batch_format="numpy",
            fn_constructor_kwargs={"target": target, "cfg": cfg, "aux_layers": header["aux_layers"], "use_gpu": use_gpu},
            compute=ActorPoolStrategy(size=actors), num_gpus=cfg.gpus_per_actor if use_gpu else 0,
            num_cpus=cfg.cpus_per_actor, **({"memory": memory} if memory > 0 else {}), **ACTOR_POOL,
        )
        with ShardProgress(out, len(todo), done) if lines else contextlib.nullcontext():
            ds.write_datasink(sink)
    else:
        sink.finish([])
    summary = store.dump_summary(sink.manifest, sink.written, len(kept), time.perf_counter() - started)
    summary["ingest"] = ingested
    summary["dead_writer_temporaries_removed"] = len(sink.leftovers)
    summary["nodes"] = sink.nodes  # which Ray node computed which of the shards written now (kept: none)
    # the start's cost: Ray's connection, and the first shard written (actor start, model load, its first shard)
    summary["phases_s"].update(ray_connect_s=round(connect_s, 3), first_shard_s=round(
        min(r["written_at"] for r in sink.written) - started_at, 3) if sink.written else None)
    location.write_text(location.join(out, SUMMARY_FILE), json.dumps(summary, indent=2) + "\n")
    return summary
