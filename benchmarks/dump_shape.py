"""The dump's target forward and shard write at a real-model shape (issue: a real LLM on real traffic, item 8).

What ``pipelines/dump.py``'s prefill actor and writer do per shard — ``features.sequence_features``
(the target's prefill in padded, length-grouped batches, top-K and logsumexp in float32 chunks, the
EAGLE-3 auxiliary states), ``features.encode_features`` (the stored arrays) and ``store.write_shard``
(Zarr, zstd, chunk checksums) — without Ray, on a target of Llama-3-8B geometry (d=4096, 32 layers,
32/8 heads of 128, MLP 14,336, vocabulary 128,256) with random bf16 weights, over ``--samples``
random sequences of ``--seq`` tokens. Measured in one run:

* ``forward``: the plain ``model(input_ids, attention_mask)`` forward with logits — the floor any dump pays;
* ``features``: ``sequence_features`` (forward with hidden states, top-K, logsumexp, copies to the host);
* ``encode`` and ``write``: the host-side encoding and the Zarr write of one shard, its bytes on disk
  and bytes per token against the uncompressed fp16 reference (2 + 2L)d + 6K + 5 bytes.

Random weights give random hidden states, which compress worse than a trained model's: ``write``'s
bytes are an upper bound. ``--layers`` shrinks the target (a CPU smoke run).

    python -m benchmarks.dump_shape OUT.json [--device cuda] [--samples 8] [--seq 2048] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.host import write_result
from specdraft.features import encode_features, pad_sequences, prefill_batches, resolve_aux_layers, sequence_features
from specdraft.configs.features import FeaturesConfig
from specdraft.store import write_shard
from specdraft.store.location import tree_bytes


def llama_8b(layers: int, vocab: int) -> LlamaConfig:
    """Llama-3-8B's geometry (rope theta 500k, 8k positions) with ``layers`` decoder layers."""
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=vocab, max_position_embeddings=8192,
                       rope_theta=500000.0, tie_word_embeddings=False, pad_token_id=0)


def timed(device: torch.device, fn):
    """``fn()``'s result and wall seconds, the device synchronised on both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


def time_shard(model, seqs: list[np.ndarray], shard: dict[str, np.ndarray], attrs: dict, cfg: FeaturesConfig,
               aux_layers: list[int], device: torch.device, reps: int, work: Path | None) -> tuple[dict, int]:
    """(seconds of each rep's plain forward, features, encoding and shard write, after one warm-up; the bytes of the
    shard written): the dump's per-shard work on ``seqs``."""

    @torch.no_grad()
    def forward():  # the floor: the same padded batches as sequence_features, logits included
        for group in prefill_batches([len(s) for s in seqs], cfg.batch_tokens, cfg.max_batch_size):
            ids, att = pad_sequences([seqs[i] for i in group], 0)  # (B, T), (B, T)
            model(input_ids=ids.to(device), attention_mask=att.to(device)).logits.sum().item()

    def features():
        return sequence_features(model, seqs, cfg, aux_layers, pad_id=0)

    rows: dict[str, list[float]] = {"forward_s": [], "features_s": [], "features_prefill_s": [], "encode_s": [],
                                    "write_s": []}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    written_bytes = 0
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        for rep in range(reps + 1):  # rep 0 warms up
            _, fwd_s = timed(device, forward)
            (feats, phases), feat_s = timed(device, features)
            prefill_s = phases["features_s"]
            arrays, enc_s = timed(device, lambda: encode_features(feats, cfg.hidden_codec, len(aux_layers)))
            arrays.update(shard)
            store = Path(tmp) / f"rep{rep}"
            _, write_s = timed(torch.device("cpu"), lambda: write_shard(
                store, 0, arrays, attrs, chunk_tokens=cfg.chunk_tokens, compression=cfg.compression,
                level=cfg.compression_level))
            written_bytes = tree_bytes(store)
            if rep:
                for key, value in zip(rows, (fwd_s, feat_s, prefill_s, enc_s, write_s)):
                    rows[key].append(round(value, 3))
            print(json.dumps({"rep": rep, "forward_s": round(fwd_s, 3), "features_s": round(feat_s, 3),
                              "encode_s": round(enc_s, 3), "write_s": round(write_s, 3)}), flush=True)
            del feats, arrays
    return rows, written_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--samples", type=int, default=8, help="sequences in the shard")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions after one warm-up (the best is kept)")
    parser.add_argument("--work", type=Path, default=None, help="where the shard is written (default: a temp dir)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = FeaturesConfig(max_length=args.seq, aux_layers="eagle3", hidden_codec="fp16")  # the dump's defaults
    aux_layers = resolve_aux_layers("eagle3", args.layers)

    conf = llama_8b(args.layers, args.vocab)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(conf).to(torch.bfloat16).eval()  # random weights, as a loaded bf16 target
    build_s = time.perf_counter() - t0
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, args.vocab, (args.seq,), generator=g).numpy().astype(np.int32)
            for _ in range(args.samples)]
    tokens = args.samples * args.seq
    # what the dump stores beside the features (features.sample_arrays' layout), and the shard's attributes
    shard = dict(input_ids=np.concatenate(seqs), loss_mask=np.ones(tokens, np.uint8),
                 offsets=np.arange(0, tokens + 1, args.seq, dtype=np.int64),
                 sample_ids=np.array([f"s{i}" for i in range(args.samples)]))
    attrs = {"d": conf.hidden_size, "k": cfg.topk, "hidden_codec": cfg.hidden_codec, "aux_layers": aux_layers}

    rows, written_bytes = time_shard(model, seqs, shard, attrs, cfg, aux_layers, device, args.reps, args.work)
    best = {key: min(values) for key, values in rows.items()}
    reference = (2 + 2 * len(aux_layers)) * conf.hidden_size + 6 * cfg.topk + 5  # bytes/token, uncompressed fp16
    result = {
        "benchmark": "dump_shape",
        "host": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},  # and write_result's
        "shape": {"d": conf.hidden_size, "layers": args.layers, "vocab": args.vocab, "heads": 32, "kv_heads": 8,
                  "intermediate": conf.intermediate_size, "dtype": "bf16", "samples": args.samples, "seq": args.seq,
                  "tokens": tokens, "aux_layers": aux_layers, "topk": cfg.topk, "batch_tokens": cfg.batch_tokens,
                  "logits_chunk": cfg.logits_chunk, "compression": f"{cfg.compression}-{cfg.compression_level}"},
        "weights_gb": round(weights_gb, 2),
        "build_s": round(build_s, 1),
        "timings_s": rows,
        "forward_tokens_per_s": round(tokens / best["forward_s"], 1),
        "features_tokens_per_s": round(tokens / best["features_s"], 1),
        "features_over_forward_time": round(best["features_s"] / best["forward_s"], 3),
        "encode_tokens_per_s": round(tokens / best["encode_s"], 1),
        "write_tokens_per_s": round(tokens / best["write_s"], 1),
        "written_bytes": written_bytes,
        "write_bytes_per_s": round(written_bytes / best["write_s"], 1),
        "bytes_per_token": round(written_bytes / tokens, 1),
        "reference_bytes_per_token": reference,
        "bytes_over_reference": round(written_bytes / tokens / reference, 3),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None,
    }
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("host", "shape", "timings_s")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
