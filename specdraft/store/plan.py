"""A dump's shard plan and its resume: which conversations go to which shard, which shards are done.

Conversations are sorted by id (duplicates dropped, the first row winning) and cut into fixed-size
shards; a shard's content depends only on its planned sample ids (its ``plan_digest``), so a rerun keeps
the complete shards of the same plan, features config and target, and redoes only the others — no
sample is ever written twice. The shard record attributes a dump writes are assembled here too.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from specdraft.chat import unique_conversations
from specdraft.store import location
from specdraft.store.schema import MANIFEST_FILE, StoreError
from specdraft.store.writer import list_shard_dirs, read_shard_record


def plan_shards(conversations: list[dict[str, Any]], samples_per_shard: int) -> tuple[list[dict[str, Any]], int]:
    """Deterministic shard rows ``{index, plan_digest, samples}`` (sorted by id, fixed-size chunks; ``samples``
    the JSON list of the shard's ``{id, messages}``) and the number of duplicate ids dropped."""
    assert samples_per_shard >= 1, f"samples_per_shard must be >= 1, got {samples_per_shard}"
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


def plan_digest(plan: list[dict[str, Any]]) -> str:
    """One digest of the whole plan (the manifest's ``input.plan_digest``)."""
    return hashlib.sha256("".join(p["plan_digest"] for p in plan).encode()).hexdigest()


def resume_shards(out: Path | str, header: dict[str, Any], plan: list[dict[str, Any]], overwrite: bool) -> list[dict[str, Any]]:
    """Records of complete shards of this same plan to keep; temporaries, shards without their record
    (a killed writer's, at a URL under the final name) and stale manifests removed."""
    finals, temps = list_shard_dirs(out)
    if overwrite:
        for path in [*finals.values(), *temps, location.join(out, MANIFEST_FILE)]:
            location.remove(path)
        return []
    for path in temps:  # a killed writer's leftovers: that shard is redone
        location.remove(path)
    kept = []
    for index, path in sorted(finals.items()):
        try:
            record = read_shard_record(path)
        except StoreError:
            location.remove(path)  # never completed: redo
            continue
        if (record.get("aux_layers") or []) != header["aux_layers"]:
            raise StoreError(
                f"{path} was dumped with aux_layers {record.get('aux_layers') or []}, this config asks for "
                f"{header['aux_layers']} (features.aux_layers={header['features']['aux_layers']!r}): a store holds one "
                "set of auxiliary layers — write to a new directory or pass overwrite=True"
            )
        same = (index < len(plan) and record.get("plan_digest") == plan[index]["plan_digest"]
                and record.get("features_hash") == header["features_hash"]
                and record.get("target_id") == header["target_id"])
        if not same:
            raise StoreError(
                f"{path} belongs to another dump (different conversations, features config or target); "
                "write to a new directory or pass overwrite=True"
            )
        kept.append(record)
    if len(kept) < len(plan):
        location.remove(location.join(out, MANIFEST_FILE))  # the store is being completed
    return kept


def shard_attrs(header: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """A dumped shard's record attributes: the store header's identity and format, and the shard's own
    plan digest, rejects, non-finite count, placement and timings (``meta``, from the dump's stages)."""
    return {
        "target_id": header["target_id"], "features_hash": header["features_hash"],
        "d": header["d"], "k": header["k"], "hidden_codec": header["hidden_codec"],
        "aux_layers": header["aux_layers"], "plan_digest": meta["plan_digest"], "rejected": meta["rejected"],
        "rejected_examples": meta["rejected_examples"], "truncated": meta["truncated"],
        "nonfinite_tokens": meta["nonfinite_tokens"], "placement": meta.get("placement"),
        "written_at": round(time.time(), 3),
        "timings": {k: round(v, 4) for k, v in meta["timings"].items()},
    }


def dump_summary(manifest: dict[str, Any], written: list[dict[str, Any]], kept: int, wall_s: float) -> dict[str, Any]:
    """Rows in/out/rejected, tokens, tokens/s of this run, bytes/token vs 2d(1+L)+6K+5 (L aux layers), and
    ``phases_s``: the written shards' timings summed (seconds of each step, on whichever worker ran it — steps of
    different shards overlap, so they add up to more than ``wall_s`` when the pipeline is full) with
    ``padding_efficiency``, the stored tokens over the prefill batches' padded B x T."""
    totals = manifest["totals"]
    new_tokens = sum(r["num_tokens"] for r in written)
    features_s = sum(r["timings"]["features_s"] for r in written)
    phases: dict[str, float] = {}
    for record in written:
        for key, value in record["timings"].items():
            phases[key] = phases.get(key, 0) + value
    padded = phases.pop("padded_tokens", 0)
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
        "phases_s": {k: round(v, 3) for k, v in sorted(phases.items())},
        "padding_efficiency": round(new_tokens / padded, 3) if padded else None,
        "bytes": totals["bytes"],
        "bytes_per_token": None if totals["bytes_per_token"] is None else round(totals["bytes_per_token"], 2),
        "bytes_per_token_reference": totals["bytes_per_token_reference"],
        "hidden_codec": manifest["hidden_codec"],
        "aux_layers": manifest.get("aux_layers") or [],
        "lossy": manifest["lossy"],
    }
