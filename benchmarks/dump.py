"""Benchmark the dump stage (``pipelines/dump.py`` over ``specdraft.features``): tokens/s vs pure target
prefill, bytes/token.

One run measures, on the same random Llama (default hidden 512, 4 layers, vocab 8k) and the
same padded length-grouped batches (``prefill_batches`` per shard):

* ``prefill``: the plain ``model(input_ids, attention_mask)`` forward (logits included), in
  this process, with the actor's thread count — the floor any dump pays;
* ``dump``: ``dump_features`` end to end through Ray Data (tokenize, prefill + top-K +
  logsumexp + encode, Zarr writes, manifest), and the actor's own feature time per token;
* bytes per stored token versus the uncompressed fp16 reference 2d + 6K + 5.

Wall-clock rates depend on what else the host runs (its load average is recorded); the CPU
time per token of each step (process CPU time: tokenize task, prefill actor, writer; and the
pure forward) is the comparison that survives a shared machine.

With ``--target`` a real target is dumped instead (``--prompts``: a prompt set's name or a file, ingested single-turn
as ``configs/smollm2.yaml`` does; the first ``--conversations`` rows), and ``reference_prefill`` — the target's own
prefill as ``benchmarks/real_model_stages.py`` measures it (4 x 256 random tokens, hidden states and logits) in the
dump's dtype — is measured before and after the dump in this process: ``dump_vs_reference_prefill`` is the whole
dump's tokens/s over it (issue 41: >= 0.7). The dump's summary carries its ``phases_s``.

Usage (from a checkout with the package installed, ``pip install -e .``):
``python -m benchmarks.dump OUT.json [--conversations 384 --hidden 512 ...]``; SmolLM2 as ``configs/smollm2.yaml``
dumps it: ``python -m benchmarks.dump OUT.json --target targets/smollm2 --prompts sharegpt --conversations 120
max_length=1024 aux_layers=eagle3 dtype=bfloat16 cpus_per_actor=1 torch_threads=2 [batch_tokens=...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.host import write_result
from specdraft.limits import LoadSampler
from benchmarks.real_model_stages import prefill_rate
from pipelines.configs import DumpConfig
from pipelines.dump import dump_features
from specdraft.chat import render_with_loss_mask
from specdraft.features import pad_sequences, prefill_batches
from specdraft.configs.features import FeaturesConfig
from specdraft.placement import resolve_dtype
from specdraft.store import plan_shards, read_manifest
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.toy.tokenizer import train_tokenizer


def build_target(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random Llama with a toy chat tokenizer (ids < vocab) saved under ``root``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [m["content"] for c in generate_conversations(2000, 0) for m in c]
    tokenizer = train_tokenizer(texts, vocab_size=min(vocab, 4096))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def long_conversations(n: int, turns_per_conversation: int, seed: int) -> list[dict]:
    """``n`` multi-turn chats, each the turns of several toy conversations in a row."""
    pool = generate_conversations(n * turns_per_conversation, seed)
    rows = []
    for i in range(n):
        messages = [m for c in pool[i * turns_per_conversation : (i + 1) * turns_per_conversation] for m in c if m["role"] != "system"]
        rows.append({"id": f"bench-{i:05d}", "messages": messages})
    return rows


def real_prompts(prompts: str, n: int) -> list[dict]:
    """The first ``n`` conversations of a prompt set (or file), ingested single-turn and short as
    ``configs/smollm2.yaml``'s ``regenerate.ingest`` keeps them."""
    from pipelines.configs import IngestConfig
    from pipelines.ingest import ingest
    from specdraft.packaged import resolve_prompt_inputs

    rows, _ = ingest(resolve_prompt_inputs([prompts]), IngestConfig(max_turns=1, max_chars=4000))
    return rows[:n]


def reference_prefill(target: Path, cfg: FeaturesConfig, threads: int) -> dict:
    """The target's prefill as ``benchmarks/real_model_stages.py`` measures it, in the dump's dtype."""
    dtype = resolve_dtype(cfg.dtype, "cpu")
    return {**prefill_rate(str(target), dtype, threads), "dtype": str(dtype).removeprefix("torch.")}


@torch.no_grad()
def time_prefill(target: Path, rows: list[dict], cfg: FeaturesConfig, threads: int) -> dict:
    """Pure prefill throughput on the dump's own batches (same tokens, same grouping)."""
    torch.set_num_threads(threads)
    tokenizer, model = load_tokenizer(target), load_target_model(target, resolve_dtype(cfg.dtype, "cpu"))
    plan, _ = plan_shards(rows, cfg.samples_per_shard)
    batches = []
    for shard in plan:
        seqs = []
        for sample in json.loads(shard["samples"]):
            ids = render_with_loss_mask(tokenizer, sample["messages"]).input_ids[: cfg.max_length]
            seqs.append(torch.tensor(ids, dtype=torch.int32).numpy())
        for group in prefill_batches([len(s) for s in seqs], cfg.batch_tokens, cfg.max_batch_size):
            batches.append(pad_sequences([seqs[i] for i in group], model.config.pad_token_id or 0))
    model(input_ids=batches[0][0], attention_mask=batches[0][1])  # warm-up
    tokens = sum(int(att.sum()) for _, att in batches)
    padded = sum(att.numel() for _, att in batches)
    started, cpu = time.perf_counter(), time.process_time()
    for ids, att in batches:
        model(input_ids=ids, attention_mask=att, use_cache=False)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"tokens": tokens, "padded_tokens": padded, "batches": len(batches), "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "cpu_ms_per_token": round(1e3 * cpu / tokens, 4)}


def cpu_ms_per_token(records: list[dict]) -> dict:
    """CPU milliseconds per stored token of each dump step, from the shards' timings."""
    tokens = sum(r["num_tokens"] for r in records)
    keys = ("tokenize_cpu_s", "actor_cpu_s", "write_cpu_s")
    out = {k.removesuffix("_cpu_s"): round(1e3 * sum(r["timings"][k] for r in records) / tokens, 4) for k in keys}
    out["total"] = round(sum(out.values()), 4)
    return out


def steady_throughput(records: list[dict]) -> float | None:
    """Tokens/s between the first and the last shard write (startup excluded); None for < 2 shards."""
    if len(records) < 2:
        return None
    records = sorted(records, key=lambda r: r["written_at"])
    span = records[-1]["written_at"] - records[0]["written_at"]
    return round(sum(r["num_tokens"] for r in records[1:]) / span, 1) if span > 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4, help="toy conversations merged into one chat")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (prefill and actor)")
    parser.add_argument("--target", default=None, help="a real target directory (default: a random Llama)")
    parser.add_argument("--prompts", default="sharegpt", help="with --target: a prompt set's name or a file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="DumpConfig overrides")
    args = parser.parse_intermixed_args(argv)  # the overrides may follow the options

    import ray

    from specdraft.config import load

    cfg = load(DumpConfig, None, ["samples_per_shard=64", "max_length=1024", "batch_tokens=8192",
                                  f"torch_threads={args.threads}", *args.overrides])
    with tempfile.TemporaryDirectory(prefix="bench-dump-") as tmp:
        tmp = Path(tmp)
        if args.target:
            target, rows = Path(args.target), real_prompts(args.prompts, args.conversations)
        else:
            target = build_target(tmp / "target", args.hidden, args.layers, args.vocab)
            rows = long_conversations(args.conversations, args.turns, seed=1)
        reference = [reference_prefill(target, cfg, args.threads)] if args.target else []
        prefill = time_prefill(target, rows, cfg, args.threads)
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
        with LoadSampler(every=2.0) as load_avg:
            summary = dump_features(target, rows, tmp / "store", cfg, progress=False)
        shard_records = read_manifest(tmp / "store")["shards"]
        ray.shutdown()
        prefill_after = time_prefill(target, rows, cfg, args.threads)  # the host's load drifts: bracket the dump
        reference += [reference_prefill(target, cfg, args.threads)] if args.target else []
    steady = steady_throughput(shard_records)
    prefill_tps = (prefill["tokens_per_s"] + prefill_after["tokens_per_s"]) / 2
    prefill_cpu = min(prefill["cpu_ms_per_token"], prefill_after["cpu_ms_per_token"])
    dump_cpu = cpu_ms_per_token(shard_records)
    result = {
        "benchmark": "dump",
        "model": ({"target": str(args.target), "prompts": args.prompts} if args.target else
                  {"arch": "llama", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab}),
        "features": {k: getattr(cfg, k) for k in ("topk", "hidden_codec", "compression", "samples_per_shard",
                                                   "batch_tokens", "max_length", "dtype", "aux_layers",
                                                   "logits_chunk", "cpus_per_actor", "torch_threads")},
        "dump_load": load_avg.summary(),
        "prefill": {"before": prefill, "after": prefill_after, "tokens_per_s": round(prefill_tps, 1),
                    "cpu_ms_per_token": prefill_cpu},
        "dump": {**summary, "steady_tokens_per_s": steady, "cpu_ms_per_token": dump_cpu},
        "dump_vs_prefill": {
            "end_to_end": round(summary["tokens_per_s"] / prefill_tps, 3),
            "steady": None if steady is None else round(steady / prefill_tps, 3),
            "actor_features": round(summary["features_tokens_per_s"] / prefill_tps, 3),
            "cpu_time_ratio": round(dump_cpu["total"] / prefill_cpu, 3),  # robust to the host's load
        },
        "bytes_per_token": summary["bytes_per_token"],
        **({"reference_prefill": reference, "dump_vs_reference_prefill": round(
            summary["tokens_per_s"] / (sum(r["tokens_per_s"] for r in reference) / len(reference)), 3)}
           if reference else {}),
        "bytes_per_token_reference": summary["bytes_per_token_reference"],
        "host": {"threads": args.threads},  # write_result adds the host's facts
    }
    print(write_result(args.out, result).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
