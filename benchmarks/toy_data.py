"""The toy data the training benchmarks share: a feature store of toy chats, held-out questions.

The store is computed in process (``specdraft.quickstart.compute_features``: the target's last hidden
state, top-K log-probs and, with ``aux_layers``, the EAGLE-3 features of "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", §3) and written with the store's own
writer (``specdraft.store.write_shard``), so every recipe trains from the same arrays.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any



def build_store(store: Path, target: Path, conversations: int, seed: int, max_length: int, topk: int,
                samples_per_shard: int, aux_layers: list[int],
                chats: list[list[dict[str, str]]] | None = None) -> dict[str, Any]:
    """A Zarr feature store of ``conversations`` toy chats (reused when already built the same way).

    With ``aux_layers`` the store also holds the EAGLE-3 features (``aux_hidden``: the states entering
    those target layers, from the same forward), so every recipe trains from the same store. ``chats``:
    these conversations instead of ``generate_conversations(conversations, seed)`` (their digest joins the
    spec; ``seed`` still names the sample ids)."""
    from specdraft.features import AUX_CONVENTION, compute_features, sample_arrays
    from specdraft.store import (
        make_manifest,
        read_manifest,
        write_manifest,
        write_shard,
    )
    from specdraft.targets.identity import target_id
    from specdraft.targets.loading import load_target_model, load_tokenizer
    from specdraft.toy.conversations import generate_conversations

    spec = {"target_id": target_id(target), "conversations": conversations, "seed": seed, "max_length": max_length,
            "topk": topk, "samples_per_shard": samples_per_shard, "aux_layers": aux_layers}
    if chats is not None:
        spec.update(conversations=len(chats),
                    chats_sha256=hashlib.sha256(json.dumps(chats, sort_keys=True).encode()).hexdigest()[:16])
    marker = store / "bench_store.json"
    if marker.is_file() and json.loads(marker.read_text()).get("spec") == spec:
        return {**json.loads(marker.read_text()), "reused": True}
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    started = time.perf_counter()
    model, tokenizer = load_target_model(target), load_tokenizer(target)
    chats = generate_conversations(conversations, seed=seed) if chats is None else chats
    samples = compute_features(model, tokenizer, chats, max_length, topk, progress=False, aux_layers=aux_layers)
    # compute_features returns the samples sorted by length; ids number them in that order and the
    # held-out split is by id hash (FeatureDataset), identical for every recipe
    d = samples[0]["hidden"].shape[-1]
    attrs = {"d": d, "k": topk, "hidden_codec": "fp16", **({"aux_layers": aux_layers} if aux_layers else {})}
    records = []
    for index, lo in enumerate(range(0, len(samples), samples_per_shard)):
        part = samples[lo : lo + samples_per_shard]
        arrays = sample_arrays(part, [f"toy-{seed}-{lo + i:06d}" for i in range(len(part))])
        records.append(write_shard(store, index, arrays, attrs))
    header = {"target_id": spec["target_id"], **attrs, **({"aux_convention": AUX_CONVENTION} if aux_layers else {})}
    write_manifest(store, make_manifest(header=header, shards=records))
    totals = read_manifest(store)["totals"]
    info = {"spec": spec, "seconds": round(time.perf_counter() - started, 1),
            "sequences": totals["sequences"], "tokens": totals["tokens"], "loss_tokens": totals["loss_tokens"],
            "bytes": totals["bytes"]}
    marker.write_text(json.dumps(info, indent=2) + "\n")
    return {**info, "reused": False}


def write_questions(path: Path, rows: list[dict[str, Any]]) -> Path:
    """MT-Bench-format question rows as JSON lines at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_toy_questions(path: Path, n: int, seed: int, max_turns: int | None) -> Path:
    """Held-out toy prompts as MT-Bench-format rows (every user turn, or the first ``max_turns``)."""
    from specdraft.toy.conversations import generate_prompts

    rows = []
    for i, conv in enumerate(generate_prompts(n, seed)):
        users = [m["content"] for m in conv if m["role"] == "user"]
        rows.append({"question_id": i, "category": "toy", "turns": users[:max_turns] if max_turns else users})
    return write_questions(path, rows)


def question_overlap(questions: Path, conversations: int, seed: int) -> int:
    """How many held-out questions open with a first user turn that also opens a chat of the store."""
    from specdraft.toy.conversations import generate_conversations

    firsts = {next(m["content"] for m in c if m["role"] == "user") for c in generate_conversations(conversations, seed)}
    rows = [json.loads(x) for x in questions.read_text().splitlines() if x.strip()]
    return sum(r["turns"][0] in firsts for r in rows)


def write_mt_bench(path: Path, source: Path, n: int, max_turns: int | None) -> Path:
    """The first ``n`` questions of an MT-Bench file, each cut to ``max_turns`` user turns."""
    rows = [json.loads(x) for x in source.read_text().splitlines() if x.strip()][:n]
    for r in rows:
        r["turns"] = r["turns"][:max_turns] if max_turns else r["turns"]
    return write_questions(path, rows)
