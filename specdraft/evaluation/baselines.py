"""The vanilla answers and prompt-lookup counts of a question set, kept on disk — tokens and counts, never
times (docs/evaluation.md; τ and speedup as in "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees", §5).

Every evaluation decodes and times vanilla and the prompt-lookup floor (PLD) itself, beside the draft, turn
by turn (``records``): a speedup divides two times measured in the same run under the same load, never a
time measured now by one measured at another moment. What vanilla and PLD produce depends only on the
target, the questions and the decode settings, not on the draft, so it is kept: an evaluation compares
its vanilla tokens and floor counts with an earlier one's and counts the turns that differ (a changed
answer means a changed setup or nondeterministic kernels; greedy decoding on one machine should give none).
Two JSON files per question set, in a cache directory, each keyed by a digest of everything that decides
its contents:

* ``vanilla-<key>.json``: the target's content fingerprint (``target.target_fingerprint``), the
  question set's digest (every question's dataset, number, id and turns, after ``max_questions``),
  the sampling settings, ``max_new_tokens``, the seed, the system prompt, dtype, attention kernel,
  the machine (host, device, workers and threads: low-order bits of a sum, hence a near-tied greedy
  token, may differ between devices and thread counts) and the torch / transformers versions;
* ``pld-<key>.json``: the vanilla key plus the prompt-lookup settings and its γ (which follows the
  draft's max depth unless ``pld.gamma`` is set: a chain γ=5 draft and a depth-5 tree share it).

Per turn (``"<question index>:<turn>"``) the vanilla file holds the prompt's digest, the tokens, rounds
and stop reason; the PLD file the prompt's digest and the ``_pld`` record fields less their times. A
turn is compared only when its prompt renders to the same token ids (a changed chat template or
tokenizer is counted stale). Files are written whole (``files.write_text``) and merged with what
another evaluation wrote meanwhile; a file that does not parse is set aside and rebuilt. The report says
what was compared (``settings.baselines``) and each record whether its vanilla answer / floor differ from
the cache's (``baseline_changed``, ``pld_changed``: None when the cache had nothing for the prompt).
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
from specdraft.targets.identity import target_fingerprint

FORMAT = 2  # 2: no times (format 1 held vanilla's and the floor's wall times)
CACHE_FIELD = "_cache"  # what a record carries to the cache (popped before the report is built)


def digest(value: Any) -> str:
    """A short stable digest of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def questions_digest(questions: list[dict[str, Any]]) -> str:
    """The question set's identity: every question's dataset, number, id and turns."""
    return digest([[q["dataset"], q["index"], q["question_id"], q["turns"]] for q in questions])


def token_digest(prompt: list[int]) -> str:
    """The digest of a prompt's token ids (what a cached baseline was decoded from)."""
    return digest(prompt)


def machine(device: torch.device, workers: int, threads: int) -> dict[str, Any]:
    """Where vanilla and the floor were decoded: their tokens are compared only on the same machine, split and
    threads (a driver without the GPU its replicas use names the GPU type it cannot see as ``"remote"``)."""
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
    compared: int = 0  # turns the file held for the same prompt: compared with this evaluation's
    changed: int = 0  # of those, turns whose tokens / counts differ from the file's
    written: int = 0  # turns written to the file (new, stale or changed)
    stale: int = 0  # cached turns whose prompt no longer renders the same

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
        self.written += len(fresh)
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
        return {"file": None if self.path is None else str(self.path), "compared": self.compared,
                "changed": self.changed, "written": self.written, "stale": self.stale, "measured_at": self.measured_at}


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
        (JSON-able; ``records.evaluate_question`` compares an entry only when the turn's prompt digest matches)."""
        out: dict[str, Any] = {"vanilla": {}, "pld": {}}
        for turn in range(1, len(question["turns"]) + 1):
            name = f"{question['index']}:{turn}"
            for kind, cache in (("vanilla", self.vanilla), ("pld", self.pld)):
                if cache is not None and name in cache.entries:
                    out[kind][str(turn)] = cache.entries[name]
        return out

    def absorb(self, records: list[dict[str, Any]]) -> None:
        """Count the comparisons the records report, pop what they carry to the cache and write it."""
        fresh: dict[str, dict[str, dict[str, Any]]] = {"vanilla": {}, "pld": {}}
        for r in records:
            carried = r.pop(CACHE_FIELD, {})
            name = f"{r['index']}:{r['turn']}"
            for kind in ("vanilla", "pld"):
                if kind in carried:
                    fresh[kind][name] = carried[kind]
            for cache, prefix in ((self.vanilla, "baseline"), (self.pld, "pld")):
                if cache is not None:
                    cache.compared += r.get(f"{prefix}_changed") is not None
                    cache.changed += bool(r.get(f"{prefix}_changed"))
                    cache.stale += bool(r.get(f"{prefix}_stale"))
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
