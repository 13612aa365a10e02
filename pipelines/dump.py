"""Dump stage: the target's per-token features into a sharded Zarr v3 store (Ray Data).

DESIGN.md "The target and its features". One Ray Data pipeline, one row per *shard*:

    plan (driver)            conversations sorted by id, chunked into fixed-size shards;
                             complete shards already on disk are kept (resume)
    -> tokenize_shard        render_with_loss_mask per conversation (tasks); over-long,
                             unrenderable and loss-free rows are counted, never silently dropped
    -> PrefillActor          the target prefill in padded, length-grouped batches (no grad,
                             inference dtype from ``FeaturesConfig``; ``gpus_per_actor`` GPUs per
                             actor on a GPU cluster, the target spread over them; SDPA kernels)
                             -> hidden, top-K ids/logits and float32 logsumexp per token
    -> ZarrShardDatasink     one ``write_shard`` per row: one writer per shard, temp dir + rename;
                             ``on_write_complete`` writes ``manifest.json`` (driver)

A shard's rows never split across blocks, so every shard has exactly one writer; its content
depends only on its planned sample ids, so a rerun redoes only missing shards and no sample
is written twice. Store layout and reader: ``specdraft/store.py``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
import ray
import torch
import transformers
import zarr
from ray.data import ActorPoolStrategy, Datasink

from pipelines.cluster import connect_ray
from specdraft import store
from specdraft.chat import render_with_loss_mask
from specdraft.config import config_hash, to_dict
from specdraft.placement import ATTN_IMPLEMENTATIONS, describe_placement, spread_gpus
from specdraft.target import load_target_config, load_target_model, load_tokenizer, target_id, target_states


@dataclass(frozen=True, kw_only=True, slots=True)
class FeaturesConfig:
    """What the dump stores and how it runs."""

    max_length: int = 2048  # tokens per conversation
    overlong: Literal["truncate", "reject"] = "truncate"
    topk: int = 10
    hidden_codec: Literal["fp16", "bf16", "int8"] = "fp16"  # int8: per-token absmax scale, lossy
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # inference; auto: bf16 on GPU, fp32 on CPU
    samples_per_shard: int = 64  # a shard is one Ray row: ~ samples * tokens * (2d + 6K + 5) bytes
    batch_tokens: int = 8192  # padded tokens per prefill batch
    max_batch_size: int = 64
    logits_chunk: int = 2048  # tokens per float32 top-K / logsumexp chunk
    num_actors: int = 1
    # GPUs per actor (GPU clusters only): the Ray request AND the target's spread — a fraction shares
    # one GPU, a whole N > 1 splits the target's layers over the actor's N GPUs (device_map)
    gpus_per_actor: float = 1.0
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"  # flash: CUDA + flash-attn only
    cpus_per_actor: float = 1.0
    torch_threads: int | None = None  # CPU threads per actor (default: cpus_per_actor)
    chunk_tokens: int = 1024  # Zarr chunk length along the token axis
    compression: Literal["zstd", "blosc", "none"] = "zstd"
    compression_level: int = 3
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        assert self.max_length >= 1 and self.topk >= 1 and self.samples_per_shard >= 1, "sizes must be >= 1"
        assert self.batch_tokens >= 1 and self.max_batch_size >= 1 and self.num_actors >= 1, "sizes must be >= 1"
        assert self.attn_implementation in ATTN_IMPLEMENTATIONS, f"unknown attn_implementation {self.attn_implementation!r}"
        spread_gpus(self.gpus_per_actor)  # a fraction or a whole number


# not in features_hash (placement and kernel: the same features up to rounding)
RUNTIME_FIELDS = ("num_actors", "gpus_per_actor", "cpus_per_actor", "torch_threads", "attn_implementation")


def features_hash(cfg: FeaturesConfig) -> str:
    """Hash of the fields that decide what is stored (resume refuses shards of another hash)."""
    return config_hash({k: v for k, v in to_dict(cfg).items() if k not in RUNTIME_FIELDS})


class InjectedFault(RuntimeError):
    """Raised by the ``fault_at_shard`` test hook: a writer dying mid-shard."""


# --- conversations and the shard plan ----------------------------------------------------------


def load_conversations(paths: Iterable[str | Path]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows ``{id, source, messages}`` and the ingest summary (None when nothing needed ingesting).

    Conversation Parquet (regenerate's output, ``pipelines.conversations``) is read as is; any
    other file (ShareGPT / OpenAI JSON(L), raw Parquet) goes through ``pipelines.ingest``, whose
    summary counts what it rejected.
    """
    from pipelines.conversations import read_conversations as read_parquet
    from pipelines.ingest import ingest

    rows, raw = [], []
    for path in map(Path, paths):
        if path.suffix == ".parquet" or path.is_dir():
            try:
                rows += read_parquet([path])
                continue
            except ValueError:  # not in the conversation schema: ingest it
                pass
        raw.append(path)
    if not raw:
        return rows, None
    ingested, summary = ingest(raw)
    return rows + ingested, summary


def plan_shards(conversations: list[dict[str, Any]], samples_per_shard: int) -> tuple[list[dict[str, Any]], int]:
    """Deterministic shard rows (sorted by id, fixed-size chunks) and the number of duplicate ids dropped."""
    unique: dict[str, list] = {}
    for row in conversations:
        unique.setdefault(str(row["id"]), row["messages"])
    ids = sorted(unique)
    plan = []
    for index, lo in enumerate(range(0, len(ids), samples_per_shard)):
        chunk = ids[lo : lo + samples_per_shard]
        plan.append({
            "index": index,
            "plan_digest": hashlib.sha256(json.dumps(chunk).encode()).hexdigest(),
            "samples": json.dumps([{"id": i, "messages": unique[i]} for i in chunk]),
        })
    return plan, len(conversations) - len(unique)


# --- stage 1: tokenize -------------------------------------------------------------------------

_TOKENIZERS: dict[str, Any] = {}


def tokenize_shard(batch: dict[str, np.ndarray], target: str, cfg: FeaturesConfig) -> dict[str, np.ndarray]:
    """One shard row -> concatenated ``input_ids``/``loss_mask``, ``offsets`` and a JSON ``meta``."""
    assert len(batch["index"]) == 1, "tokenize_shard takes one shard per batch"
    if target not in _TOKENIZERS:
        _TOKENIZERS[target] = load_tokenizer(target, trust_remote_code=cfg.trust_remote_code)
    tokenizer = _TOKENIZERS[target]
    t0, c0 = time.perf_counter(), time.process_time()
    ids, masks, kept = [], [], []
    rejected = {"unrenderable": 0, "too_long": 0, "no_loss_tokens": 0}
    examples: dict[str, list[str]] = {k: [] for k in rejected}
    truncated = 0
    for sample in json.loads(str(batch["samples"][0])):
        try:
            r = render_with_loss_mask(tokenizer, sample["messages"])
        except Exception:  # noqa: BLE001 - any template/format failure: count the row, keep going
            reason = "unrenderable"
        else:
            reason = None
            ids_, mask_ = r.input_ids, r.loss_mask
            if len(ids_) > cfg.max_length:
                if cfg.overlong == "reject":
                    reason = "too_long"
                else:
                    truncated += 1
                    ids_, mask_ = ids_[: cfg.max_length], mask_[: cfg.max_length]
            if reason is None and not any(mask_):
                reason = "no_loss_tokens"
        if reason is not None:
            rejected[reason] += 1
            examples[reason] = (examples[reason] + [sample["id"]])[:5]
            continue
        ids.append(ids_)
        masks.append(mask_)
        kept.append(sample["id"])
    lengths = [len(x) for x in ids]
    meta = {"index": int(batch["index"][0]), "plan_digest": str(batch["plan_digest"][0]), "sample_ids": kept,
            "rejected": rejected, "rejected_examples": {k: v for k, v in examples.items() if v},
            "truncated": truncated,
            "timings": {"tokenize_s": time.perf_counter() - t0, "tokenize_cpu_s": time.process_time() - c0}}
    return {
        "index": batch["index"],
        "input_ids": np.asarray([np.asarray([t for x in ids for t in x], np.int32)]),  # (1, N)
        "loss_mask": np.asarray([np.asarray([t for x in masks for t in x], np.uint8)]),  # (1, N)
        "offsets": np.asarray([np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)]),  # (1, S+1)
        "meta": np.asarray([json.dumps(meta)]),
    }


# --- stage 2: target prefill ------------------------------------------------------------------


def prefill_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group sequence indices into padded batches by length: B * T_max <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_batch_size and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)  # sorted descending: the batch's first sequence is its longest
        else:
            batches.append([i])
    return batches


def pad_sequences(seqs: list[np.ndarray], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` (B, T)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    att = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(s.astype(np.int64))
        att[row, : len(s)] = 1
    return ids, att


class PrefillActor:
    """A target replica: shard rows of tokens in, shard rows of features out."""

    def __init__(self, target: str, cfg: FeaturesConfig, use_gpu: bool) -> None:
        self.cfg = cfg
        transformers.utils.logging.disable_progress_bar()  # one weight-loading bar per actor is noise
        if not use_gpu:
            torch.set_num_threads(cfg.torch_threads or max(1, int(cfg.cpus_per_actor)))
        # on GPU the actor holds gpus_per_actor GPUs (Ray's request) and spreads the target over them
        self.model = load_target_model(target, cfg.dtype, "cuda" if use_gpu else "cpu",
                                       trust_remote_code=cfg.trust_remote_code,
                                       gpus=spread_gpus(cfg.gpus_per_actor) if use_gpu else 1,
                                       attn_implementation=cfg.attn_implementation)
        self.placement = describe_placement(self.model)  # recorded in every shard it writes
        self.pad_id = self.model.config.pad_token_id or 0

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert len(batch["index"]) == 1, "PrefillActor takes one shard per batch"
        started, cpu = time.perf_counter(), time.process_time()
        offsets = np.asarray(batch["offsets"][0], np.int64)
        seqs = np.split(np.asarray(batch["input_ids"][0], np.int32), offsets[1:-1]) if len(offsets) > 1 else []
        features, features_s = self.features(seqs)
        meta = json.loads(str(batch["meta"][0]))
        meta["nonfinite_tokens"] = int(features.pop("nonfinite_tokens"))
        meta["placement"] = self.placement
        meta["timings"].update(features_s=features_s, actor_s=time.perf_counter() - started,
                               actor_cpu_s=time.process_time() - cpu)
        out = {k: np.asarray([v]) for k, v in features.items()}  # (1, ...)
        return {**out, "index": batch["index"], "input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"],
                "offsets": batch["offsets"], "meta": np.asarray([json.dumps(meta)])}

    @torch.no_grad()
    def features(self, seqs: list[np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        """Stored per-token arrays for ``seqs`` (concatenated in their order) and the seconds spent in
        prefill + top-K + logsumexp (excluding padding/copies/encoding)."""
        cfg, d = self.cfg, self.model.config.hidden_size
        per_seq: list[tuple[torch.Tensor, ...] | None] = [None] * len(seqs)
        prefill_s = 0.0
        for group in prefill_batches([len(s) for s in seqs], cfg.batch_tokens, cfg.max_batch_size):
            ids, att = pad_sequences([seqs[i] for i in group], self.pad_id)
            t0 = time.perf_counter()
            hidden, logits = target_states(self.model, ids, att)  # (B, T, d), (B, T, V) on the lm_head's device
            valid = att.to(hidden.device).bool()  # (B, T)
            h, lg = hidden[valid], logits[valid]  # (M, d), (M, V): rows concatenated in order
            lse, top_v, top_i = [], [], []
            for lo in range(0, lg.shape[0], cfg.logits_chunk):
                part = lg[lo : lo + cfg.logits_chunk].float()  # (m, V)
                lse.append(torch.logsumexp(part, dim=-1))  # (m,)
                top = part.topk(cfg.topk, dim=-1)
                top_v.append(top.values)  # (m, K)
                top_i.append(top.indices)  # (m, K)
            if hidden.device.type == "cuda":
                torch.cuda.synchronize(hidden.device)  # the last GPU of a spread target finishes last
            prefill_s += time.perf_counter() - t0
            parts = (h.cpu(), torch.cat(top_i).cpu(), torch.cat(top_v).cpu(), torch.cat(lse).cpu())
            sizes = [len(seqs[i]) for i in group]
            for i, pieces in zip(group, zip(*(p.split(sizes) for p in parts))):
                per_seq[i] = pieces
        cols = list(zip(*per_seq)) if seqs else [[torch.zeros(0, d)], [torch.zeros(0, cfg.topk, dtype=torch.long)],
                                                 [torch.zeros(0, cfg.topk)], [torch.zeros(0)]]
        hidden = torch.cat(cols[0])  # (N, d)
        topk_logits = torch.cat(cols[2]).to(torch.float16)  # (N, K)
        out = store.encode_hidden(hidden, cfg.hidden_codec)
        out.update(
            topk_ids=torch.cat(cols[1]).to(torch.int32).numpy(),  # (N, K)
            topk_logits=topk_logits.numpy(),  # (N, K)
            logsumexp=torch.cat(cols[3]).float().numpy(),  # (N,)
        )
        finite = torch.isfinite(topk_logits).all(-1)  # (N,)
        for lo in range(0, len(finite), 4096):  # what a reader will decode (fp16 overflow included)
            scale = out["hidden_scale"][lo : lo + 4096] if "hidden_scale" in out else None
            stored = store.decode_hidden(out["hidden"][lo : lo + 4096], cfg.hidden_codec, scale)  # (n, d)
            finite[lo : lo + 4096] &= torch.isfinite(stored).all(-1)
        out["nonfinite_tokens"] = np.asarray(int((~finite).sum()))
        return out, prefill_s


# --- stage 3: the shard writer ----------------------------------------------------------------


class ZarrShardDatasink(Datasink):
    """Writes each row (one complete shard) with ``store.write_shard``; manifest on completion."""

    def __init__(self, out: Path, header: dict[str, Any], cfg: FeaturesConfig, kept: list[dict[str, Any]],
                 fault_at_shard: int | None = None) -> None:
        self.out, self.header, self.cfg, self.kept = Path(out), header, cfg, kept
        self.fault_at_shard = fault_at_shard
        self.written: list[dict[str, Any]] = []
        self.manifest: dict[str, Any] | None = None

    def write(self, blocks, ctx) -> list[dict[str, Any]]:
        from ray.data.block import BlockAccessor

        records = []
        for block in blocks:
            for row in BlockAccessor.for_block(block).iter_rows(public_row_format=False):
                records.append(self.write_row(row))
        return records

    def write_row(self, row: dict[str, Any]) -> dict[str, Any]:
        meta = json.loads(str(row["meta"]))
        index = int(meta["index"])
        if index == self.fault_at_shard:  # test hook: die with a half-written temporary shard
            group = zarr.open_group(store=str(self.out / store.temp_shard_name(index)), mode="w", zarr_format=3)
            group.create_array("input_ids", data=np.asarray(row["input_ids"], np.int32))
            raise InjectedFault(f"injected fault while writing shard {index}")
        arrays = {name: np.asarray(row[name]) for name in store.TOKEN_ARRAYS + ("offsets",)}
        if "hidden_scale" in row:
            arrays["hidden_scale"] = np.asarray(row["hidden_scale"])
        arrays["sample_ids"] = np.asarray(meta["sample_ids"], dtype=str)
        attrs = {
            "target_id": self.header["target_id"], "features_hash": self.header["features_hash"],
            "d": self.header["d"], "k": self.header["k"], "hidden_codec": self.header["hidden_codec"],
            "plan_digest": meta["plan_digest"], "rejected": meta["rejected"],
            "rejected_examples": meta["rejected_examples"], "truncated": meta["truncated"],
            "nonfinite_tokens": meta["nonfinite_tokens"], "placement": meta.get("placement"),
            "written_at": round(time.time(), 3),
            "timings": {k: round(v, 4) for k, v in meta["timings"].items()},
        }
        t0, c0 = time.perf_counter(), time.process_time()
        record = store.write_shard(self.out, index, arrays, attrs, chunk_tokens=self.cfg.chunk_tokens,
                                   compression=self.cfg.compression, level=self.cfg.compression_level)
        # write timings reach the manifest (this run's records) but not the shard's own attributes
        record["timings"] = {**record["timings"], "write_s": round(time.perf_counter() - t0, 4),
                             "write_cpu_s": round(time.process_time() - c0, 4)}
        return record

    def on_write_complete(self, write_result) -> None:
        self.finish([r for returns in write_result.write_returns for r in (returns or [])])

    def finish(self, written: list[dict[str, Any]]) -> None:
        """Write ``manifest.json`` from kept + newly written shard records (driver side)."""
        self.written = written
        shards = self.kept + self.written
        missing = sorted(set(range(self.header["num_shards"])) - {r["index"] for r in shards})
        if missing:
            raise store.StoreError(f"{self.out}: shards {missing[:10]} were not written; not writing a manifest")
        self.manifest = store.make_manifest(header=self.header, shards=shards)
        store.write_manifest(self.out, self.manifest)


# --- driver ------------------------------------------------------------------------------------


def store_header(target: str, cfg: FeaturesConfig, plan: list[dict[str, Any]], num_rows: int, duplicates: int) -> dict[str, Any]:
    """Everything in the manifest besides the shard records: target, features, plan."""
    tconf = load_target_config(target, trust_remote_code=cfg.trust_remote_code)
    return {
        "target_id": target_id(target),
        "target_path": str(Path(target).resolve()),
        "target_config_hash": config_hash(tconf.to_dict()),
        "model_type": tconf.model_type,
        "vocab_size": tconf.vocab_size,
        "d": int(tconf.hidden_size),
        "k": cfg.topk,
        "hidden_codec": cfg.hidden_codec,
        "features": to_dict(cfg),
        "features_hash": features_hash(cfg),
        "samples_per_shard": cfg.samples_per_shard,
        "num_shards": len(plan),
        "input": {"rows": num_rows, "duplicate_ids": duplicates,
                  "plan_digest": hashlib.sha256("".join(p["plan_digest"] for p in plan).encode()).hexdigest()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "zarr": zarr.__version__},
    }


def resume_state(out: Path, header: dict[str, Any], plan: list[dict[str, Any]], overwrite: bool) -> list[dict[str, Any]]:
    """Records of complete shards of this same plan to keep; temporaries and stale manifests removed."""
    finals, temps = store.list_shard_dirs(out)
    if overwrite:
        for path in [*finals.values(), *temps, out / store.MANIFEST_FILE]:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return []
    for path in temps:  # a killed writer's leftovers: that shard is redone
        shutil.rmtree(path, ignore_errors=True)
    kept = []
    for index, path in sorted(finals.items()):
        try:
            record = store.read_shard_record(path)
        except store.StoreError:
            shutil.rmtree(path, ignore_errors=True)  # never completed: redo
            continue
        same = (index < len(plan) and record.get("plan_digest") == plan[index]["plan_digest"]
                and record.get("features_hash") == header["features_hash"]
                and record.get("target_id") == header["target_id"])
        if not same:
            raise store.StoreError(
                f"{path} belongs to another dump (different conversations, features config or target); "
                "write to a new directory or pass overwrite=True"
            )
        kept.append(record)
    if len(kept) < len(plan):
        (out / store.MANIFEST_FILE).unlink(missing_ok=True)  # the store is being completed
    return kept


def dump_features(
    target: str | Path,
    conversations: list[dict[str, Any]],
    out: str | Path,
    cfg: FeaturesConfig = FeaturesConfig(),
    *,
    progress: bool = True,
    overwrite: bool = False,
    fault_at_shard: int | None = None,
) -> dict[str, Any]:
    """Dump ``conversations`` (rows ``{id, messages}``) through ``target`` into the store ``out``.

    Resumes: complete shards of the same plan are kept, the rest (re)written. Returns the summary
    (also what ``specdraft dump`` prints). ``fault_at_shard`` is a test hook that kills the
    writer of that shard mid-write.
    """
    started = time.perf_counter()
    target, out = str(Path(target).resolve()), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan, duplicates = plan_shards(conversations, cfg.samples_per_shard)
    header = store_header(target, cfg, plan, len(conversations), duplicates)
    kept = resume_state(out, header, plan, overwrite)
    done = {r["index"] for r in kept}
    todo = [row for row in plan if row["index"] not in done]
    sink = ZarrShardDatasink(out, header, cfg, kept, fault_at_shard)
    if todo:
        connect_ray()  # RAY_ADDRESS, or a local cluster
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        ray.data.DataContext.get_current().enable_progress_bars = progress
        ds = ray.data.from_items(todo, override_num_blocks=len(todo))
        ds = ds.map_batches(tokenize_shard, batch_size=1, batch_format="numpy", fn_kwargs={"target": target, "cfg": cfg})
        ds = ds.map_batches(
            PrefillActor, batch_size=1, batch_format="numpy",
            fn_constructor_kwargs={"target": target, "cfg": cfg, "use_gpu": use_gpu},
            compute=ActorPoolStrategy(size=min(cfg.num_actors, len(todo))),
            num_gpus=cfg.gpus_per_actor if use_gpu else 0, num_cpus=cfg.cpus_per_actor,
        )
        ds.write_datasink(sink)
    else:
        sink.finish([])
    return summarize(sink.manifest, sink.written, len(kept), time.perf_counter() - started)


def summarize(manifest: dict[str, Any], written: list[dict[str, Any]], kept: int, wall_s: float) -> dict[str, Any]:
    """Rows in/out/rejected, tokens, tokens/s of this run, bytes/token vs 2d+6K+5."""
    totals = manifest["totals"]
    new_tokens = sum(r["num_tokens"] for r in written)
    features_s = sum(r["timings"]["features_s"] for r in written)
    return {
        "rows_in": manifest["input"]["rows"],
        "duplicate_ids": manifest["input"]["duplicate_ids"],
        "rows_out": totals["sequences"],
        "rejected": totals["rejected"],
        "truncated": totals["truncated"],
        "nonfinite_tokens": sum(r.get("nonfinite_tokens", 0) for r in manifest["shards"]),
        "tokens": totals["tokens"],
        "loss_tokens": totals["loss_tokens"],
        "shards": manifest["num_shards"],
        "shards_written": len(written),
        "shards_kept": kept,
        "tokens_written": new_tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(new_tokens / wall_s, 1) if wall_s > 0 else None,
        "features_tokens_per_s": round(new_tokens / features_s, 1) if features_s > 0 else None,  # actor: prefill + top-K + lse
        "bytes": totals["bytes"],
        "bytes_per_token": None if totals["bytes_per_token"] is None else round(totals["bytes_per_token"], 2),
        "bytes_per_token_reference": totals["bytes_per_token_reference"],
        "hidden_codec": manifest["hidden_codec"],
        "lossy": manifest["lossy"],
    }
