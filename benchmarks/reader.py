"""Benchmark the feature-store reader (specdraft/store/reader.py) against the trainer it feeds.

Issue 12.4's goal: the reader delivers tokens at least 5x as fast as one training step consumes
them, at a toy shape and at an 8B-like one (d = 4096). One run, per shape:

* a store written with the real writer (``write_shard``, zstd, fp16 hidden codec, K = 10) from
  synthetic states: ``--sequences`` sequences of 512-2048 tokens, 64 per shard;
* ``reader``: one epoch of ``FeatureDataset`` batches as the trainer receives them (stored fp16
  form, read ahead on the background thread) — tokens/s of non-padding tokens; also
  ``decoded`` (each batch then ``.to("cpu")``: the float32 decode a CPU trainer pays) and
  ``per_sequence`` (the reader before 12.4: one read per sequence and array, float32 decode on the
  host, ``pad_batch``), for comparison;
* ``trainer``: ``train_batch`` (forward + backward, plain stage) + AdamW step of an EAGLE draft of
  the same d on a reader batch (toy: up to 2048 padded tokens; d = 4096: one sequence of ~512), fp32
  on CPU, after one warm-up step. The toy draft is d = 64 over a
  320-token vocabulary; the 8B-like one has Llama-3-8B's layer geometry (d = 4096, 32 heads, 8 KV
  heads, MLP 14336) over a 2048-token vocabulary (the target vocabulary only changes the frozen
  head's cost, which makes the trainer faster here and the ratio conservative);
* ``ratio`` = reader tokens/s / trainer tokens/s (wall clock); ``ratio_cpu`` the same per CPU second
  of this process (all its threads), the comparison that survives a shared host.

* ``integrity`` (issue 22: integrity checked on read; budget 5 %): the same features written twice, with
  per-chunk crc32c checksums (every chunk read verified, and checked for presence) and without (the
  store layout before them). At the toy shape the features are real — the toy target's hidden states and
  top-K of ``--conversations`` toy chats, as a dump computes them — at d = 4096 synthetic. ``--repeats``
  pairs of epochs, one of each store back to back, the order alternating (tokens/s of each); then the same
  epochs batch by batch, each batch read from both stores at once, the order alternating: the cost is the
  median of those pairs' time ratios (CPU and wall seconds) with a bootstrap 95 % interval, beside the
  crc32c work timed alone (``integrity_rates``). On a loaded host the load changes from one second to the
  next; a pair's two reads, milliseconds apart, share it. In the same run, the same two stores read through
  Zarr's async array reads (``zarr_path``: the reader's read path at e44983f, before issue 22's cost was
  cut) give the before: its cost and its tokens per CPU second. ``--integrity-only`` skips everything else.

Wall-clock rates depend on what else the host runs (its load average is recorded).

Usage: ``python -m benchmarks.reader [OUT.json (default benchmarks/results/reader.json)] [--sequences 48]
[--integrity-only] [--repeats 11] [--integrity-data model|synthetic] [--conversations 3000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.host import write_result
from specdraft.batch import pad_batch
from specdraft.models import build_draft
from specdraft.configs.draft import DraftConfig
from specdraft.objectives import train_batch
from specdraft.configs.stages import LossWeights, StageConfig
from specdraft.store import FeatureDataset, decode_hidden, encode_hidden, make_manifest, write_manifest, write_shard
from specdraft.configs.reader import ReaderConfig

K = 10
SHAPES = {  # name -> (d, heads, kv heads, MLP width, vocabulary, padded tokens of the timed training batch)
    "toy": (64, 4, 2, 128, 320, 2048),
    "8b_like": (4096, 32, 8, 14336, 2048, 512),  # one sequence: ~3 TFLOP per 2048 tokens is minutes on 2 cores
}


def synthetic_shards(d: int, vocab: int, sequences: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Synthetic features of ``sequences`` sequences (512-2048 tokens; hidden states N(0, 1) in fp16), 64 per
    shard, as the writer takes them."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for index, lo in enumerate(range(0, sequences, 64)):
        lengths = rng.integers(512, 2049, size=min(64, sequences - lo))
        n = int(lengths.sum())
        arrays = encode_hidden(torch.randn(n, d, generator=gen), "fp16")  # (N, d) float16
        arrays.update(
            input_ids=rng.integers(0, vocab, size=n).astype(np.int32),
            loss_mask=(rng.random(n) < 0.7).astype(np.uint8),
            topk_ids=rng.integers(0, vocab, size=(n, K)).astype(np.int32),
            topk_logits=rng.normal(size=(n, K)).astype(np.float16),
            logsumexp=rng.normal(size=n).astype(np.float32) + 5,
            offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            sample_ids=np.asarray([f"s{index}-{j}" for j in range(len(lengths))]),
        )
        shards.append(arrays)
    return shards


def model_shards(conversations: int, seed: int = 0, per_shard: int = 256) -> tuple[list[dict[str, np.ndarray]], int]:
    """(shards, d): the features a dump of the toy target (the trained build shipped with specdraft, d = 64)
    stores for ``conversations`` toy chats — real, compressible hidden states and top-K log-probs
    (``specdraft.features.compute_features``, the dump's own computation), ``per_shard`` sequences a shard."""
    from specdraft.features import compute_features, sample_arrays
    from specdraft.targets.loading import load_target_model, load_tokenizer
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig
    from specdraft.toy.conversations import generate_conversations

    with tempfile.TemporaryDirectory(prefix="reader-bench-target-") as tmp:
        target = build_toy_target(Path(tmp) / "target", ToyTargetConfig(), progress=False, prebuilt=True)
        model, tokenizer = load_target_model(target), load_tokenizer(target)
        samples = compute_features(model, tokenizer, generate_conversations(conversations, seed=seed), 512, K,
                                   progress=False)
    shards = [sample_arrays(samples[lo : lo + per_shard], [f"c{lo + i:06d}" for i in range(len(samples[lo : lo + per_shard]))])
              for lo in range(0, len(samples), per_shard)]
    return shards, int(samples[0]["hidden"].shape[-1])


def write_store(root: Path, shards: list[dict[str, np.ndarray]], d: int, chunk_checksums: bool = True) -> dict:
    """``shards`` written with the store's writer (``chunk_checksums=False``: as before the per-chunk checksums)."""
    started = time.perf_counter()
    attrs = {"d": d, "k": K, "hidden_codec": "fp16", "target_id": "bench"}
    records = [write_shard(root, index, arrays, attrs, chunk_checksums=chunk_checksums)
               for index, arrays in enumerate(shards)]
    manifest = make_manifest(header={"target_id": "bench", "d": d, "k": K, "hidden_codec": "fp16"}, shards=records)
    write_manifest(root, manifest)
    totals = manifest["totals"]
    return {"sequences": totals["sequences"], "tokens": totals["tokens"], "shards": len(records),
            "bytes_per_token": round(totals["bytes_per_token"], 1), "write_s": round(time.perf_counter() - started, 2)}


def build_store(root: Path, d: int, vocab: int, sequences: int, seed: int = 0, chunk_checksums: bool = True) -> dict:
    """Synthetic features (``synthetic_shards``) written to ``root``."""
    return write_store(root, synthetic_shards(d, vocab, sequences, seed), d, chunk_checksums)


def per_sequence_load(ds: FeatureDataset, seqs: list[int]):
    """The reader before issue 12.4: one read per sequence and array, float32 decode, ``pad_batch``."""
    samples = []
    for i in seqs:
        key = int(ds._key[i])
        arrays, codec = ds._arrays(key), ds._shards[key][1]
        a, b = int(ds._start[i]), int(ds._start[i] + ds._length[i])
        lse = torch.from_numpy(arrays["logsumexp"][a:b])  # (L,)
        samples.append({
            "input_ids": torch.from_numpy(arrays["input_ids"][a:b].astype(np.int64)),  # (L,)
            "hidden": decode_hidden(arrays["hidden"][a:b], codec),  # (L, d)
            "loss_mask": torch.from_numpy(arrays["loss_mask"][a:b].astype(bool)),  # (L,)
            "topk_ids": torch.from_numpy(arrays["topk_ids"][a:b].astype(np.int64)),  # (L, K)
            "topk_logp": torch.from_numpy(arrays["topk_logits"][a:b]).float() - lse[:, None],  # (L, K)
        })
    return pad_batch(samples)


def reader_rates(store: Path, max_tokens: int) -> dict:
    """Non-padding tokens/s of one epoch: stored form (prefetched), decoded, and per-sequence reads."""
    out = {}
    for mode in ("stored", "decoded", "per_sequence"):
        ds = FeatureDataset(store, ReaderConfig(max_tokens=max_tokens, seed=1), split="all")  # fresh zarr handles
        tokens, started, cpu = 0, time.perf_counter(), time.process_time()
        if mode == "per_sequence":
            for seqs in ds.batches(0):
                tokens += int(per_sequence_load(ds, seqs).valid.sum())
        else:
            for batch in ds:
                batch = batch.to("cpu") if mode == "decoded" else batch
                tokens += int(batch.valid.sum())
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu  # cpu: all threads of the process
        out[mode] = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                     "cpu_s": round(cpu_s, 3), "tokens_per_cpu_s": round(tokens / cpu_s, 1)}
    out["batches"] = len(FeatureDataset(store, ReaderConfig(max_tokens=max_tokens, seed=1), split="all").batches(0))
    return out


def _epoch(ds: FeatureDataset, epoch: int) -> tuple[int, float, float]:
    """(tokens, wall s, CPU s of this process: all threads) of one epoch read in stored form."""
    ds.set_epoch(epoch)
    tokens, started, cpu = 0, time.perf_counter(), time.process_time()
    for batch in ds:
        tokens += int(batch.valid.sum())
    return tokens, time.perf_counter() - started, time.process_time() - cpu


def _spread(values: list[float]) -> dict[str, float]:
    q = np.quantile(values, [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
    return {name: round(float(v), 4) for name, v in zip(("min", "p10", "p25", "median", "p75", "p90", "max"), q)}


def _median_ci(values: list[float], seed: int = 0, draws: int = 4000) -> list[float]:
    """A bootstrap 95 % interval of the median of ``values``."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(np.asarray(values), size=(draws, len(values)), replace=True), axis=1)
    return [round(float(x), 4) for x in np.quantile(medians, [0.025, 0.975])]


def zarr_path(ds: FeatureDataset) -> FeatureDataset:
    """``ds`` reading every array through Zarr's own (async) array reads, as the reader did at e44983f,
    instead of the chunk-by-chunk synchronous decode (``ShardArray`` without codecs: its fallback for
    object stores). The same checks: Zarr's crc32c codec on decode, the presence listing."""
    import dataclasses

    for key in range(len(ds._shards)):
        ds._open[key] = {name: dataclasses.replace(source, codecs=None, spec=None)
                         for name, source in ds._sources(key).items()}
    return ds


def crc_cost(store: Path, ds: FeatureDataset, epoch: int) -> dict:
    """The check's own work apart from everything else an epoch does: the chunks Zarr's crc32c codec checks
    in one epoch of ``ds`` (counted in the codec; a chunk is read again by every batch whose rows it holds)
    and the CPU seconds ``google_crc32c`` (the codec's implementation) takes over that many bytes of this
    store's chunks, held in memory but not in cache — a reference, not a floor: the reader checks a chunk's
    bytes right after reading them, still in cache, where the crc32c runs several times faster (chunks of
    at most ``writer.CHUNK_BYTES``)."""
    import google_crc32c
    import zarr.codecs.crc32c_ as codec

    calls, checked = [0], [0]

    class Counting:  # the codec's module attribute, for one epoch
        @staticmethod
        def value(data) -> int:
            calls[0] += 1
            checked[0] += memoryview(data).nbytes
            return google_crc32c.value(data)

    codec.google_crc32c = Counting
    try:
        _epoch(ds, epoch)
    finally:
        codec.google_crc32c = google_crc32c
    chunks = [np.frombuffer(p.read_bytes(), np.uint8) for pattern in ("c/*", "c/*/*")
              for p in sorted(store.rglob(pattern)) if p.is_file()]
    stored = sum(len(c) - 4 for c in chunks)
    times = []
    for _ in range(5):
        cpu = time.process_time()
        for data in chunks:
            google_crc32c.value(data[:-4])  # as Zarr's codec: the chunk's bytes but its stored checksum
        times.append(time.process_time() - cpu)
    per_byte = float(np.median(times)) / stored
    return {"chunks_stored": len(chunks), "bytes_stored": stored, "chunks_checked_per_epoch": calls[0],
            "bytes_checked_per_epoch": checked[0], "reads_per_chunk": round(calls[0] / len(chunks), 2),
            "gb_per_cpu_s": round(1e-9 / per_byte, 2), "cpu_s_per_epoch": round(per_byte * checked[0], 5)}


def _ratio_of_sums_ci(v: np.ndarray, u: np.ndarray, seed: int = 0, draws: int = 4000) -> list[float]:
    """A bootstrap 95 % interval (pairs resampled) of sum(v) / sum(u)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(v), size=(draws, len(v)))
    ratios = v[idx].sum(axis=1) / u[idx].sum(axis=1)
    return [round(float(x), 4) for x in np.quantile(ratios, [0.025, 0.975])]


def _paired(v: list[float], u: list[float]) -> dict:
    """Verified vs unverified times of the same work, pair by pair: the ratio of their sums with its bootstrap
    interval, and the per-pair ratios' median (with its interval) and spread."""
    v_, u_ = np.asarray(v), np.asarray(u)
    per_pair = list(v_ / u_)
    return {"pairs": len(v), "ratio_of_sums": round(float(v_.sum() / u_.sum()), 4),
            "ratio_of_sums_ci95": _ratio_of_sums_ci(v_, u_), "per_pair": _spread(per_pair),
            "per_pair_median_ci95": _median_ci(per_pair), "pairs_verified_slower": int((v_ > u_).sum())}


def integrity_rates(shards: list[dict[str, np.ndarray]], d: int, max_tokens: int, pairs: int, data: str) -> dict:
    """The cost of the per-chunk check on read, measured so that it shows on a loaded, noisy host.

    The same ``shards`` are written twice, with per-chunk crc32c (every chunk read verified, and checked for
    presence, on read) and without (the layout before them); each store is opened once, as a training run
    opens it, and read one untimed epoch each. Then ``pairs`` epochs of each:

    * ``epochs``: pairs of epochs, one of each store back to back in stored form (read ahead on the
      background thread, as the trainer receives them), the order alternating (ABBA), the same epoch number
      (the same batch plan) for both — tokens/s of each, and per pair the time ratio verified / unverified
      (wall and CPU seconds of the process);
    * ``batches``: the same epochs again, batch by batch: each batch read from one store and then, at once,
      the same batch from the other (``load``, on this thread), the order alternating — thousands of pairs
      milliseconds apart, so a change of the host's load hits both members of a pair: the median of the
      pairs' time ratios, with its bootstrap 95 % interval, is the cost (``cost_pct`` of wall, ``cost_cpu_pct``
      of CPU seconds; the median, as one pair hit by a burst of load moves the ratio of the summed times).

    Every ratio has its per-pair spread and the count of pairs where the verified read was slower.
    ``crc32c`` is the check's own work timed alone (``crc_cost``: the bytes the codec checks in an epoch,
    counted, at the crc32c speed measured over chunks not in cache) as a share of an unverified epoch's
    CPU time: a reference that no other process disturbs.

    ``before``: the same stores read through Zarr's async array reads (``zarr_path``, the reader's read path
    at e44983f) as two more members of every epoch round and batch round (all four in rotating order): the
    cost that path's check had, measured the same way, and its tokens per CPU second beside this reader's."""
    import warnings

    from specdraft.limits import LoadSampler
    from specdraft.store import StoreWarning

    names = ("verified", "unverified", "verified_zarr", "unverified_zarr")
    runs: dict[str, list[tuple[int, float, float]]] = {name: [] for name in names}
    batch_times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="reader-bench-integrity-") as tmp, LoadSampler(every=2.0) as load:
        stores = {name: Path(tmp, name) for name in names[:2]}
        built = {name: write_store(path, shards, d, chunk_checksums=name == "verified") for name, path in stores.items()}
        datasets, open_s = {}, {}
        for name in names:  # opened once, as a training run does (listing each shard's chunks)
            started = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", StoreWarning)
                datasets[name] = FeatureDataset(stores[name.removesuffix("_zarr")],
                                                ReaderConfig(max_tokens=max_tokens, seed=1), split="all")
            if name.endswith("_zarr"):
                zarr_path(datasets[name])
            datasets[name].load(datasets[name].batches(0)[0])  # opens the shards' arrays
            open_s[name] = round(time.perf_counter() - started, 3)
        for name in names:  # a warm-up epoch of each (page cache, Zarr's handles), not timed
            _epoch(datasets[name], 0)
        for i in range(pairs):  # rounds of one epoch of each, the order rotating (each first and last in turn)
            for name in _rotated(names, i):
                runs[name].append(_epoch(datasets[name], i))
        flip = 0
        for i in range(pairs):
            plan = datasets["verified"].batches(i)
            assert plan == datasets["unverified"].batches(i), "the two stores' batch plans differ"
            for seqs in plan:
                flip += 1
                for name in _rotated(names, flip):
                    wall, cpu = time.perf_counter(), time.process_time()
                    datasets[name].load(seqs, lazy=True)
                    batch_times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        crc = crc_cost(stores["verified"], datasets["verified"], pairs)
    return _integrity_report(names, runs, batch_times, built, open_s, crc, pairs, data, load.summary())


def _integrity_report(names: tuple[str, ...], runs: dict[str, list[tuple[int, float, float]]],
                      batch_times: dict[str, list[tuple[float, float]]], built: dict[str, Any],
                      open_s: dict[str, float], crc: dict[str, Any], pairs: int, data: str,
                      host_load: dict[str, Any]) -> dict:
    """``integrity_rates``'s result from its measured epochs and batch pairs (the fields its docstring names)."""
    assert all(len({runs[n][i][0] for n in names}) == 1 for i in range(pairs)), "the rounds read different tokens"
    out: dict = {"data": data, "pairs": pairs, "order": "rotating which read is first in a round (of all four)"}
    for name in names[:2]:
        tokens = [t for t, _, _ in runs[name]]
        out[name] = {"store": built[name], "open_s": open_s[name],
                     "tokens_per_s": round(float(np.median([t / w for t, w, _ in runs[name]])), 1),
                     "tokens_per_cpu_s": round(float(np.median([t / c for t, _, c in runs[name]])), 1),
                     "epoch_s": _spread([w for _, w, _ in runs[name]]), "tokens_per_epoch": tokens[0]}
    out["epochs"] = {"wall": _paired([w for _, w, _ in runs["verified"]], [w for _, w, _ in runs["unverified"]]),
                     "cpu": _paired([c for _, _, c in runs["verified"]], [c for _, _, c in runs["unverified"]])}
    out["batches"] = {"wall": _paired(*([w for w, _ in batch_times[n]] for n in names[:2])),
                      "cpu": _paired(*([c for _, c in batch_times[n]] for n in names[:2]))}
    unverified_cpu = float(np.median([c for _, _, c in runs["unverified"]]))
    out["crc32c"] = {**crc, "share_of_unverified_epoch_cpu_pct": round(100 * crc["cpu_s_per_epoch"] / unverified_cpu, 2)}
    for key, clock in (("cost_pct", "wall"), ("cost_cpu_pct", "cpu")):  # the batch pairs' median: the estimate
        paired = out["batches"][clock]
        out[key] = round(100 * (paired["per_pair"]["median"] - 1), 2)
        out[f"{key}_ci95"] = [round(100 * (x - 1), 2) for x in paired["per_pair_median_ci95"]]
    out["budget_pct"] = 5.0
    out["within_budget"] = out["cost_pct_ci95"][1] <= 5.0 and out["cost_cpu_pct_ci95"][1] <= 5.0
    before = {"read_path": "Zarr's async array reads (the reader at e44983f), the same stores, in the same rounds"}
    for name in names[2:]:
        before[name.removesuffix("_zarr")] = {
            "open_s": open_s[name],
            "tokens_per_s": round(float(np.median([t / w for t, w, _ in runs[name]])), 1),
            "tokens_per_cpu_s": round(float(np.median([t / c for t, _, c in runs[name]])), 1)}
    before["batches_cpu"] = _paired(*([c for _, c in batch_times[n]] for n in names[2:]))
    before["cost_cpu_pct"] = round(100 * (before["batches_cpu"]["per_pair"]["median"] - 1), 2)
    before["cost_cpu_pct_ci95"] = [round(100 * (x - 1), 2) for x in before["batches_cpu"]["per_pair_median_ci95"]]
    # this reader's CPU time per batch over the Zarr path's, checked store: the per-pair median (< 1: faster)
    speed = _paired([c for _, c in batch_times["verified"]], [c for _, c in batch_times["verified_zarr"]])
    before["verified_cpu_ratio_now_over_before"] = speed["per_pair"]["median"]
    before["verified_cpu_ratio_now_over_before_ci95"] = speed["per_pair_median_ci95"]
    out["before"] = before
    out["host_load"] = host_load
    return out


def _rotated(names: tuple[str, ...], i: int) -> tuple[str, ...]:
    """``names`` rotated by ``i`` and reversed every other round: each member goes first, and last, in turn."""
    k = i % len(names)
    order = names[k:] + names[:k]
    return order if (i // len(names)) % 2 == 0 else order[::-1]


def trainer_rate(store: Path, d: int, heads: int, kv: int, mlp: int, vocab: int, max_tokens: int, steps: int) -> dict:
    """Tokens/s of ``train_batch`` + AdamW step of an EAGLE draft at width ``d`` (fp32, CPU)."""
    torch.manual_seed(0)
    cfg = DraftConfig(arch="eagle", vocab_size=vocab, hidden_size=d, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=d // heads, intermediate_size=mlp)
    draft = build_draft(cfg, embed=torch.randn(vocab, d) * 0.02, lm_head=torch.randn(vocab, d) / d**0.5)
    optim = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    stage = StageConfig(kind="plain", noise_std=0.0, loss=LossWeights(ce=1.0))
    ds = FeatureDataset(store, ReaderConfig(max_tokens=max_tokens, seed=1, shuffle=False), split="all")
    batch = ds.load(ds.batches(0)[0], lazy=True).to("cpu")
    times, cpu_times = [], []
    for _ in range(steps + 1):  # the first is a warm-up
        started, cpu = time.perf_counter(), time.process_time()
        train_batch(draft, batch, stage)
        optim.step()
        optim.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu)
    step_s, step_cpu_s = float(np.median(times[1:])), float(np.median(cpu_times[1:]))
    tokens = int(batch.valid.sum())
    return {"arch": "eagle", "stage": "plain", "vocab": vocab, "d": d, "heads": heads, "kv_heads": kv, "mlp": mlp,
            "trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
            "batch_shape": list(batch.input_ids.shape), "tokens_per_step": tokens, "step_s": round(step_s, 3),
            "tokens_per_s": round(tokens / step_s, 1), "step_cpu_s": round(step_cpu_s, 3),
            "tokens_per_cpu_s": round(tokens / step_cpu_s, 1), "threads": torch.get_num_threads()}


def integrity_of(name: str, d: int, vocab: int, sequences: int, args: argparse.Namespace) -> dict:
    """``integrity_rates`` of shape ``name``: real features of the toy target at the toy shape (unless
    ``--integrity-data synthetic``), synthetic ones at d = 4096 (no model of that width here)."""
    if name == "toy" and args.integrity_data == "model":
        shards, width = model_shards(args.conversations)
        data = f"the toy target's features (real hidden states, d={width}) of {args.conversations} toy chats"
        return integrity_rates(shards, width, args.max_tokens, args.repeats, data)
    data = f"synthetic: {sequences} sequences of 512-2048 tokens, N(0, 1) hidden states in fp16, random top-K"
    return integrity_rates(synthetic_shards(d, vocab, sequences), d, args.max_tokens, args.repeats, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).resolve().parent / "results" / "reader.json"),
                        help="JSON result path (default: benchmarks/results/reader.json)")
    parser.add_argument("--sequences", type=int, default=0, help="sequences per store (default: 256 toy, 48 at d=4096)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=2, help="timed training steps (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=16384, help="reader batch budget (ReaderConfig.max_tokens)")
    parser.add_argument("--train-tokens", type=int, default=0, help="batch budget of the timed training step "
                        "(default: 2048 toy, 512 at d=4096)")
    parser.add_argument("--integrity-only", action="store_true",
                        help="only the with/without per-chunk checksums comparison (no trainer, no other modes)")
    parser.add_argument("--repeats", type=int, default=11,
                        help="epochs of each store in the integrity comparison (read in pairs, then batch by batch)")
    parser.add_argument("--integrity-data", choices=("model", "synthetic"), default="model",
                        help="toy shape's integrity store: the toy target's real features (default) or synthetic ones")
    parser.add_argument("--conversations", type=int, default=3000,
                        help="toy chats whose real features make the integrity store (--integrity-data model)")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    result = {"benchmark": "reader", "host": {"loadavg_at_start": os.getloadavg()},  # write_result adds the host's facts
              "config": {"max_tokens": args.max_tokens, "k": K,
                         "hidden_codec": "fp16", "compression": "zstd-3", "prefetch": ReaderConfig().prefetch},
              "shapes": {}}
    for name in args.shapes:
        d, heads, kv, mlp, vocab, train_tokens = SHAPES[name]
        sequences = args.sequences or (256 if name == "toy" else 48)
        if args.integrity_only:
            entry = {"integrity": integrity_of(name, d, vocab, sequences, args)}
            result["shapes"][name] = entry
            print(json.dumps({name: entry}, indent=1), flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix=f"reader-bench-{name}-") as tmp:
            store = Path(tmp)
            entry = {"store": build_store(store, d, vocab, sequences)}
            entry["reader"] = reader_rates(store, args.max_tokens)
            entry["trainer"] = trainer_rate(store, d, heads, kv, mlp, vocab, args.train_tokens or train_tokens, args.steps)
        entry["ratio"] = round(entry["reader"]["stored"]["tokens_per_s"] / entry["trainer"]["tokens_per_s"], 1)
        entry["ratio_decoded"] = round(entry["reader"]["decoded"]["tokens_per_s"] / entry["trainer"]["tokens_per_s"], 1)
        entry["ratio_per_sequence"] = round(entry["reader"]["per_sequence"]["tokens_per_s"]
                                            / entry["trainer"]["tokens_per_s"], 1)
        entry["integrity"] = integrity_of(name, d, vocab, sequences, args)
        entry["ratio_cpu"] = round(entry["reader"]["stored"]["tokens_per_cpu_s"] / entry["trainer"]["tokens_per_cpu_s"], 1)
        result["shapes"][name] = entry
        print(json.dumps({name: entry}, indent=1), flush=True)
    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
