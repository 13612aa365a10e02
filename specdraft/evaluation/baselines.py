"""Floors and baselines computed once: the vanilla baseline and the prompt-lookup floor of a question
set, cached on disk (docs/evaluation.md; τ and speedup as in "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees", §5).

Vanilla decoding and prompt-lookup decoding (PLD) of a question set depend only on the target, the
questions and the decode settings — not on the draft — so an evaluation of a second draft on the
same questions reads them instead of decoding them again. Two JSON files per question set, in a
cache directory, each keyed by a digest of everything that decides its contents:

* ``vanilla-<key>.json``: the target's content fingerprint (``target.target_fingerprint``), the
  question set's digest (every question's dataset, number, id and turns, after ``max_questions``),
  the sampling settings, ``max_new_tokens``, the seed, the system prompt, dtype, attention kernel,
  the machine (host, device, workers and threads: the baseline's *time* is only comparable on the
  same machine under the same split) and the torch / transformers versions;
* ``pld-<key>.json``: the vanilla key plus the prompt-lookup settings and its γ (which follows the
  draft's max depth unless ``pld.gamma`` is set: a chain γ=5 draft and a depth-5 tree share it).

Per turn (``"<question index>:<turn>"``) the vanilla file holds the prompt's digest, the tokens,
wall time, rounds and stop reason; the PLD file the prompt's digest and the ``_pld`` record fields.
A turn is reused only when its prompt renders to the same token ids (a changed chat template or
tokenizer is decoded again, and counted). Files are written whole (``files.write_text``) and merged
with what another evaluation wrote meanwhile; a file that does not parse is set aside and rebuilt.
The report says what was reused (``settings.baselines``) and each record whether its baseline /
floor came from the cache (``baseline_cached``, ``pld_cached``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from specdraft import files
from specdraft.configs.evaluation import EvalSettings
from specdraft.placement import resolve_dtype
from specdraft.target import target_fingerprint

FORMAT = 1
CACHE_FIELD = "_cache"  # what a record carries to the cache (popped before the report is built)


def digest(value: Any) -> str:
    """A short stable digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def questions_digest(questions: list[dict[str, Any]]) -> str:
    """The question set's identity: every question's dataset, number, id and turns."""
    return digest([[q["dataset"], q["index"], q["question_id"], q["turns"]] for q in questions])


def prompt_digest(prompt: list[int]) -> str:
    return digest(prompt)


def machine(device: torch.device, workers: int, threads: int) -> dict[str, Any]:
    """Where a baseline's time was measured: comparable only on the same machine, split and threads (a
    driver without the GPU its replicas use names the GPU type it cannot see as ``"remote"``)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "remote"
    else:
        name = platform.processor() or platform.machine()
    return {"host": platform.node(), "device": device.type, "device_name": name, "cpus": os.cpu_count(),
            "workers": workers, "threads": threads}


@dataclass
class CacheFile:
    """One cache file: its key, and its per-turn entries (``"<index>:<turn>"``)."""

    path: Path | None  # None: caching is off
    key: dict[str, Any]
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    measured_at: str | None = None  # when the entries read from disk were first written
    reused: int = 0  # turns read from the file
    measured: int = 0  # turns decoded (and written to the file)
    stale: int = 0  # cached turns whose prompt no longer renders the same (decoded again)

    @classmethod
    def open(cls, directory: Path | None, kind: str, key: dict[str, Any]) -> CacheFile:
        if directory is None:
            return cls(None, key)
        path = directory / f"{kind}-{digest(key)}.json"
        found = cls(path, key)
        data = _read(path)
        if data is not None and data.get("key") == key:
            found.entries, found.measured_at = dict(data.get("turns", {})), data.get("created")
        return found

    def save(self, fresh: dict[str, dict[str, Any]]) -> None:
        """Merge ``fresh`` entries into the file (entries another evaluation wrote meanwhile are kept)."""
        self.measured += len(fresh)
        if self.path is None or not fresh:
            return
        data = _read(self.path)
        turns = dict(data.get("turns", {})) if data is not None and data.get("key") == self.key else {}
        turns.update(self.entries)
        turns.update(fresh)
        self.entries = turns
        created = (data or {}).get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z")
        payload = {"format": FORMAT, "key": self.key, "created": created, "turns": turns}
        files.write_text(self.path, json.dumps(payload, sort_keys=True) + "\n")

    def summary(self) -> dict[str, Any]:
        return {"file": None if self.path is None else str(self.path), "reused": self.reused,
                "measured": self.measured, "stale": self.stale, "measured_at": self.measured_at}


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        aside = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        os.replace(path, aside)
        print(f"[specdraft] WARNING: eval baseline cache {path} does not parse: moved to {aside}, rebuilt",
              file=sys.stderr, flush=True)
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


@dataclass
class Baselines:
    """The vanilla and prompt-lookup caches of one evaluation (``pld`` None: the floor is off)."""

    vanilla: CacheFile
    pld: CacheFile | None

    @classmethod
    def open(cls, directory: str | Path | None, *, fingerprint: str, questions: list[dict[str, Any]],
             decode: dict[str, Any], pld: dict[str, Any] | None, where: dict[str, Any]) -> Baselines:
        """``decode``: the settings vanilla decoding depends on; ``pld``: the floor's settings (its γ
        resolved), None when off; ``where``: ``machine(...)`` and the dtype / kernel."""
        folder = None if directory is None else Path(directory)
        key = {"format": FORMAT, "target_fingerprint": fingerprint, "questions": questions_digest(questions),
               "decode": decode, "where": where, "torch": torch.__version__,
               "transformers": transformers.__version__}
        vanilla = CacheFile.open(folder, "vanilla", key)
        floor = None if pld is None else CacheFile.open(folder, "pld", {**key, "pld": pld})
        return cls(vanilla, floor)

    def for_question(self, question: dict[str, Any]) -> dict[str, Any]:
        """What the cache holds for this question's turns: ``{"vanilla": {turn: entry}, "pld": {...}}``
        (JSON-able; ``records.evaluate_question`` uses an entry only when the turn's prompt digest matches)."""
        out: dict[str, Any] = {"vanilla": {}, "pld": {}}
        for turn in range(1, len(question["turns"]) + 1):
            name = f"{question['index']}:{turn}"
            for kind, cache in (("vanilla", self.vanilla), ("pld", self.pld)):
                if cache is not None and name in cache.entries:
                    out[kind][str(turn)] = cache.entries[name]
        return out

    def absorb(self, records: list[dict[str, Any]]) -> None:
        """Count the reuse the records report, pop what they carry to the cache and write it."""
        fresh: dict[str, dict[str, dict[str, Any]]] = {"vanilla": {}, "pld": {}}
        for r in records:
            carried = r.pop(CACHE_FIELD, {})
            name = f"{r['index']}:{r['turn']}"
            for kind in ("vanilla", "pld"):
                if kind in carried:
                    fresh[kind][name] = carried[kind]
            self.vanilla.reused += bool(r.get("baseline_cached"))
            self.vanilla.stale += bool(r.get("baseline_stale"))
            if self.pld is not None:
                self.pld.reused += bool(r.get("pld_cached"))
                self.pld.stale += bool(r.get("pld_stale"))
        self.vanilla.save(fresh["vanilla"])
        if self.pld is not None:
            self.pld.save(fresh["pld"])

    def summary(self) -> dict[str, Any]:
        return {"vanilla": self.vanilla.summary(), "pld": None if self.pld is None else self.pld.summary()}


def baselines_dir(settings: EvalSettings, report_path: str | Path | None, home: str | Path | None = None) -> Path | None:
    """Where the vanilla / floor cache lives (``EvalSettings.baselines``): "auto" is ``home`` when the
    caller names one (the flow: ``<workdir>/eval/baselines``), else beside the report, else nowhere
    (an evaluation that writes no report caches nothing)."""
    if settings.baselines == "off":
        return None
    if settings.baselines != "auto":
        return Path(settings.baselines)
    if home is not None:
        return Path(home)
    return None if report_path is None else Path(report_path).parent / "baselines"


def open_baselines(directory: Path | None, target_dir: str | Path, questions: list[dict[str, Any]],
                   settings: EvalSettings, device: torch.device, workers: int, threads: int) -> Baselines:
    """The vanilla / floor cache of these questions under these settings (``Baselines``)."""
    decode = {"temperature": settings.decode.temperature, "top_k": settings.decode.top_k,
              "top_p": settings.decode.top_p, "max_new_tokens": settings.decode.max_new_tokens, "seed": settings.seed,
              "system_prompt": settings.system_prompt}
    pld = None
    if settings.pld.enabled:
        pld = {"gamma": settings.pld.resolved_gamma(settings.decode), "max_ngram": settings.pld.max_ngram,
               "min_ngram": settings.pld.min_ngram}
    where = {**machine(device, workers, threads), "dtype": str(resolve_dtype(settings.dtype, device)),
             "attn_implementation": settings.attn_implementation, "gpus": settings.gpus}
    return Baselines.open(directory, fingerprint=target_fingerprint(target_dir), questions=questions, decode=decode,
                          pld=pld, where=where)
