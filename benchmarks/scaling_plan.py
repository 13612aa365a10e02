"""The points of ``benchmarks/data_scaling.py``: nested prefixes of a store, what a resumed run keeps, a served
drafter's numbers at its fastest K, and the progress lines with their ETA.

A prefix is the shortest run of the store's training split, in a fixed order, that holds the asked tokens: the
order is the sample ids sorted by ``sha256(seed:sample id)`` — independent of how the dump laid the shards out,
the same in two stores of the same conversations — so a smaller size's sequences are always the larger's first.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

VAL_FRACTION = 0.05  # the store's held-out split (benchmarks.real_model.shared_settings'): every size's


def keyed(mode: str, recipe: str, size: int) -> str:
    """A point's name: in the JSON, and the engine's drafter name (no "/": it names export folders)."""
    return f"{mode}-{recipe}-{size}"


def ordered_samples(store: Path, seed: int) -> list[tuple[str, int]]:
    """(sample id, tokens) of the store's training split in the prefixes' order."""
    from specdraft.configs.reader import ReaderConfig
    from specdraft.store import FeatureDataset

    ds = FeatureDataset([store], ReaderConfig(val_fraction=VAL_FRACTION, prefetch=0), split="train")
    rows = list(zip(ds.sample_ids, (int(n) for n in ds.lengths)))
    return sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r[0]}".encode()).digest())


def prefixes(store: Path, sizes: list[int], seed: int) -> dict[int, dict[str, Any]]:
    """Per size the prefix holding at least that many tokens (its sample ids, sequences, tokens, longest sequence,
    a digest of its ids), or ``{"skipped": why}`` when the training split holds fewer tokens."""
    rows = ordered_samples(store, seed)
    total = sum(n for _, n in rows)
    out: dict[int, dict[str, Any]] = {}
    for size in sizes:
        if size > total:
            out[size] = {"skipped": f"the store's training split holds {total:,} tokens ({len(rows)} sequences), "
                                    f"fewer than {size:,}: dump more conversations"}
            continue
        tokens, n = 0, 0
        while tokens < size:
            tokens, n = tokens + rows[n][1], n + 1
        ids = [s for s, _ in rows[:n]]
        out[size] = {"samples": ids, "sequences": n, "tokens": tokens, "longest": max(t for _, t in rows[:n]),
                     "split_tokens": total, "digest": hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]}
    return out


def planned_steps(store: Path, samples: list[str], max_tokens: int, seed: int, epochs: int) -> int:
    """Optimizer steps our reader plans over ``samples`` for ``epochs`` (the peer's when no recipe of ours trained
    the point)."""
    from specdraft.configs.reader import ReaderConfig
    from specdraft.store import FeatureDataset

    ds = FeatureDataset([store], ReaderConfig(max_tokens=max_tokens, val_fraction=VAL_FRACTION, seed=seed, prefetch=0),
                        split="train", samples=samples)
    return sum(len(ds.global_batches(e)) for e in range(epochs))


def resume_key(args: Any, target: Path) -> dict[str, Any]:
    """The settings every point of a run shares: a JSON written under others is not resumed."""
    from specdraft.store import read_manifest

    stores = {m: {"dir": str(s.resolve()), "tokens": read_manifest(s)["totals"]["tokens"]}
              for m, s in args.stores.items()}
    key = {"target": str(target), "stores": stores, "epochs": args.epochs, "max_tokens": args.max_tokens,
           "lr": args.lr, "precision": args.precision, "seed": args.seed, "val_batches": args.val_batches,
           "k": list(args.k), "questions": [str(q) for q in args.questions], "max_questions": args.max_questions,
           "max_new_tokens": args.max_new_tokens, "engine_max_len": args.engine_max_len}
    return json.loads(json.dumps(key))  # as it reads back


def served_point(sweep: dict[str, Any], label: str) -> dict[str, Any] | None:
    """A drafter's numbers at its fastest K in a sweep (``engine_sweep.sweep_report``): acceptance, speedup,
    tokens/s, the load then, per question set, and its cost model; None when it was not served."""
    k = sweep.get("best_k", {}).get(label)
    if k is None:
        return None
    row = sweep[label][str(k)]
    return {"k": k, "acceptance_length": row["acceptance_length"], "speedup": row["speedup"],
            "tokens_per_s": row["tokens_per_s"], "load_1m": row.get("load_1m"),
            "datasets": {s: {"acceptance_length": d.get("acceptance_length"), "speedup": d.get("speedup")}
                         for s, d in (row.get("datasets") or {}).items()},
            "cost": sweep["cost"].get(label)}


def _clock(seconds: float) -> str:
    m = int(seconds // 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{int(seconds % 60):02d}s"


class Progress:
    """The run's steps (train a point, serve a size) still to do, and a line before each: its number, the time
    so far and the ETA from the rates measured in this run (training: seconds per token-epoch; serving: per
    drafter and K served)."""

    def __init__(self, args: Any, cut: dict[str, dict[int, dict[str, Any]]], points: dict[str, Any],
                 engines: dict[str, Any]) -> None:
        self.points, self.started, self.count = points, time.perf_counter(), 0
        self.rates: dict[str, list[float]] = {"train": [0.0, 0.0], "serve": [0.0, 0.0]}  # seconds, units
        self.todo: dict[str, tuple[str, float]] = {}
        for size in args.sizes:
            drafters = 0
            for mode, sizes in cut.items():
                if "skipped" in sizes[size]:
                    continue
                for recipe in [*args.recipes, *(["speculators"] if size in args.peer_sizes else [])]:
                    drafters += 1
                    if not self.trained(keyed(mode, recipe, size), quiet=True):
                        self.todo[keyed(mode, recipe, size)] = ("train", sizes[size]["tokens"] * args.epochs)
            served = len(engines.get(str(size), {}).get("labels", []))
            if drafters and not args.no_engine and (served < drafters or any(
                    k.endswith(f"-{size}") for k in self.todo)):
                self.todo[str(size)] = ("serve", (drafters + 1) * len(args.k))
        self.total = len(self.todo)

    def trained(self, key: str, quiet: bool = False) -> bool:
        """Whether the point was trained by an earlier session and its draft is still there."""
        train = (self.points.get(key) or {}).get("train") or {}
        if train.get("draft") and Path(train["draft"]).is_dir():
            return True
        if train and not quiet:
            print(f"[data_scaling] {key}: its draft {train.get('draft')} is gone: trained again", file=sys.stderr,
                  flush=True)
        return False

    def eta(self) -> str:
        left = {"train": 0.0, "serve": 0.0}
        for kind, units in self.todo.values():
            left[kind] += units
        unknown = [k for k, u in left.items() if u and not self.rates[k][1]]
        if unknown:
            return f"ETA after the first {' and '.join(unknown)}"
        return "ETA " + _clock(sum(u * self.rates[k][0] / self.rates[k][1] for k, u in left.items() if u))

    def line(self, what: str) -> None:
        self.count += 1
        print(f"[data_scaling] {self.count}/{self.total} {what} (elapsed {_clock(time.perf_counter() - self.started)}, "
              f"{self.eta()})", file=sys.stderr, flush=True)

    def done(self, kind: str, key: str, seconds: float) -> None:
        _, units = self.todo.pop(key, (kind, 0.0))
        self.rates[kind][0] += seconds
        self.rates[kind][1] += units
