"""Dump stage: the target's per-token features into a sharded Zarr v3 store (Ray Data).

DESIGN.md "The target and its features". One Ray Data pipeline, one row per *shard*:

    plan (driver)            conversations sorted by id, chunked into fixed-size shards;
                             complete shards already on disk are kept (resume)
    -> tokenize_shard        chat.tokenize_conversation per conversation (tasks); over-long,
                             unrenderable and loss-free rows are counted, never silently dropped
    -> PrefillActor          the target prefill in padded, length-grouped batches (no grad,
                             inference dtype from ``FeaturesConfig``; ``gpus_per_actor`` GPUs per
                             actor on a GPU cluster, the target spread over them; SDPA kernels)
                             -> hidden, top-K ids/logits and float32 logsumexp per token
                             (+ the auxiliary layers' states with ``aux_layers``: EAGLE-3 features)
    -> ZarrShardDatasink     one ``write_shard`` per row: one writer per shard, temp dir + rename
                             (at an ``s3://``/fsspec URL: in place, the shard record last);
                             ``on_write_complete`` writes ``manifest.json`` last (driver)

A shard's rows never split across blocks, so every shard has exactly one writer; its content
depends only on its planned sample ids, so a rerun redoes only missing shards and no sample
is written twice. Store layout and reader: ``specdraft/store/``.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import transformers
import zarr
from ray.data import ActorPoolStrategy, Datasink

from pipelines.cluster import connect_ray
from specdraft import store
from specdraft.chat import REJECT_REASONS, tokenize_conversation, unique_conversations
from specdraft.config import config_hash, to_dict
from specdraft.features import FeaturesConfig, aux_layers_of, features_hash
from specdraft.placement import describe_placement, spread_gpus
from specdraft.store import location
from specdraft.target import (
    AUX_CONVENTION,
    load_target_config,
    load_target_model,
    load_tokenizer,
    pad_sequences,
    target_id,
    token_features,
)


class InjectedFault(RuntimeError):
    """Raised by the ``fault_at_shard`` test hook: a writer dying mid-shard."""


# --- conversations and the shard plan ----------------------------------------------------------


def plan_shards(conversations: list[dict[str, Any]], samples_per_shard: int) -> tuple[list[dict[str, Any]], int]:
    """Deterministic shard rows (sorted by id, fixed-size chunks) and the number of duplicate ids dropped."""
    ordered, duplicates = unique_conversations(conversations)
    unique = dict(ordered)
    ids = [sample_id for sample_id, _ in ordered]
    plan = []
    for index, lo in enumerate(range(0, len(ids), samples_per_shard)):
        chunk = ids[lo : lo + samples_per_shard]
        plan.append({
            "index": index,
            "plan_digest": hashlib.sha256(json.dumps(chunk).encode()).hexdigest(),
            "samples": json.dumps([{"id": i, "messages": unique[i]} for i in chunk]),
        })
    return plan, duplicates


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
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    examples: dict[str, list[str]] = {k: [] for k in rejected}
    truncated = 0
    for sample in json.loads(str(batch["samples"][0])):
        tokens = tokenize_conversation(tokenizer, sample["messages"], cfg.max_length, cfg.overlong)
        truncated += tokens.truncated
        if tokens.rejected is not None:
            rejected[tokens.rejected] += 1
            examples[tokens.rejected] = (examples[tokens.rejected] + [sample["id"]])[:5]
            continue
        ids.append(tokens.input_ids)
        masks.append(tokens.loss_mask)
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
        self.aux_layers = aux_layers_of(cfg, self.model.config)
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
        aux_width = d * len(self.aux_layers)
        per_seq: list[tuple[torch.Tensor, ...] | None] = [None] * len(seqs)
        prefill_s = 0.0
        for group in prefill_batches([len(s) for s in seqs], cfg.batch_tokens, cfg.max_batch_size):
            ids, att = pad_sequences([seqs[i] for i in group], self.pad_id)
            t0 = time.perf_counter()
            # rows in order: (M, d), (M, K), (M, K), (M,), (M, L*d) on the lm_head's device
            h, top_i, top_v, lse, aux = token_features(self.model, ids, att, cfg.topk, cfg.logits_chunk,
                                                       self.aux_layers)
            if h.device.type == "cuda":
                torch.cuda.synchronize(h.device)  # the last GPU of a spread target finishes last
            prefill_s += time.perf_counter() - t0
            parts = (h.cpu(), top_i.cpu(), top_v.cpu(), lse.cpu(), aux.cpu())
            sizes = [len(seqs[i]) for i in group]
            for i, pieces in zip(group, zip(*(p.split(sizes) for p in parts))):
                per_seq[i] = pieces
        cols = list(zip(*per_seq)) if seqs else [[torch.zeros(0, d)], [torch.zeros(0, cfg.topk, dtype=torch.long)],
                                                 [torch.zeros(0, cfg.topk)], [torch.zeros(0)], [torch.zeros(0, aux_width)]]
        hidden = torch.cat(cols[0])  # (N, d)
        topk_logits = torch.cat(cols[2]).to(torch.float16)  # (N, K)
        out = store.encode_hidden(hidden, cfg.hidden_codec)
        if self.aux_layers:
            out.update(store.encode_hidden(torch.cat(cols[4]), cfg.hidden_codec, name="aux_hidden",
                                           parts=len(self.aux_layers)))  # (N, L*d) (+ (N, L) scales)
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
            if self.aux_layers:
                scale = out["aux_hidden_scale"][lo : lo + 4096] if "aux_hidden_scale" in out else None
                stored = store.decode_hidden(out["aux_hidden"][lo : lo + 4096], cfg.hidden_codec, scale)  # (n, L*d)
                finite[lo : lo + 4096] &= torch.isfinite(stored).all(-1)
        out["nonfinite_tokens"] = np.asarray(int((~finite).sum()))
        return out, prefill_s


# --- stage 3: the shard writer ----------------------------------------------------------------


class ZarrShardDatasink(Datasink):
    """Writes each row (one complete shard) with ``store.write_shard``; manifest on completion."""

    def __init__(self, out: Path | str, header: dict[str, Any], cfg: FeaturesConfig, kept: list[dict[str, Any]],
                 fault_at_shard: int | None = None) -> None:
        self.out, self.header, self.cfg, self.kept = location.as_location(out), header, cfg, kept
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
        if index == self.fault_at_shard:  # test hook: die with a half-written shard (where its writer writes)
            name = store.shard_name(index) if location.is_url(self.out) else store.temp_shard_name(index)
            group = location.open_group(location.join(self.out, name), "w")
            group.create_array("input_ids", data=np.asarray(row["input_ids"], np.int32))
            raise InjectedFault(f"injected fault while writing shard {index}")
        arrays = {name: np.asarray(row[name]) for name in store.TOKEN_ARRAYS + ("offsets",)}
        for name in ("hidden_scale", *store.AUX_ARRAYS):
            if name in row:
                arrays[name] = np.asarray(row[name])
        arrays["sample_ids"] = np.asarray(meta["sample_ids"], dtype=str)
        attrs = {
            "target_id": self.header["target_id"], "features_hash": self.header["features_hash"],
            "d": self.header["d"], "k": self.header["k"], "hidden_codec": self.header["hidden_codec"],
            "aux_layers": self.header["aux_layers"], "plan_digest": meta["plan_digest"], "rejected": meta["rejected"],
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
    aux_layers = aux_layers_of(cfg, tconf)
    return {
        "target_id": target_id(target),
        "target_path": str(Path(target).resolve()),
        "target_config_hash": config_hash(tconf.to_dict()),
        "model_type": tconf.model_type,
        "vocab_size": tconf.vocab_size,
        "d": int(tconf.hidden_size),
        "k": cfg.topk,
        "hidden_codec": cfg.hidden_codec,
        "aux_layers": aux_layers,  # HF output_hidden_states indices of aux_hidden's L slices ([]: none stored)
        "aux_convention": AUX_CONVENTION,
        "features": to_dict(cfg),
        "features_hash": features_hash(cfg, aux_layers),
        "samples_per_shard": cfg.samples_per_shard,
        "num_shards": len(plan),
        "input": {"rows": num_rows, "duplicate_ids": duplicates,
                  "plan_digest": hashlib.sha256("".join(p["plan_digest"] for p in plan).encode()).hexdigest()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "zarr": zarr.__version__},
    }


def resume_state(out: Path | str, header: dict[str, Any], plan: list[dict[str, Any]], overwrite: bool) -> list[dict[str, Any]]:
    """Records of complete shards of this same plan to keep; temporaries, shards without their record
    (a killed writer's, at a URL under the final name) and stale manifests removed."""
    finals, temps = store.list_shard_dirs(out)
    if overwrite:
        for path in [*finals.values(), *temps, location.join(out, store.MANIFEST_FILE)]:
            location.remove(path)
        return []
    for path in temps:  # a killed writer's leftovers: that shard is redone
        location.remove(path)
    kept = []
    for index, path in sorted(finals.items()):
        try:
            record = store.read_shard_record(path)
        except store.StoreError:
            location.remove(path)  # never completed: redo
            continue
        if (record.get("aux_layers") or []) != header["aux_layers"]:
            raise store.StoreError(
                f"{path} was dumped with aux_layers {record.get('aux_layers') or []}, this config asks for "
                f"{header['aux_layers']} (features.aux_layers={header['features']['aux_layers']!r}): a store holds one "
                "set of auxiliary layers — write to a new directory or pass overwrite=True"
            )
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
        location.remove(location.join(out, store.MANIFEST_FILE))  # the store is being completed
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
    target, out = str(Path(target).resolve()), location.as_location(out)
    location.make_dirs(out)
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
    """Rows in/out/rejected, tokens, tokens/s of this run, bytes/token vs 2d(1+L)+6K+5 (L aux layers)."""
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
        "aux_layers": manifest.get("aux_layers") or [],
        "lossy": manifest["lossy"],
    }
