"""What crosses between the driver and the engine process (``engine_process``) of the engine measurement
(docs/evaluation.md): the request — target, exported drafts, questions, engine
and sampling settings — and the engine's answers and counters, prompt for prompt. Plain JSON both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRequest:
    """What the engine process runs (JSON between the processes)."""

    target: str
    # name -> vLLM's speculative_config less its K: {"model": the exported directory, "method": vLLM's ("eagle",
    # ...)}, or a drafter of the engine's own (``engine.ngram_drafter``: {"method": "ngram", "prompt_lookup_max": ...})
    drafts: dict[str, dict[str, Any]]
    questions: list[dict[str, Any]]  # ``questions.load_question_sets`` rows
    settings: dict[str, Any]  # ``EngineSettings``
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    seed: int = 0
    system_prompt: str | None = None


@dataclass
class EngineRun:
    """The engine's answers and counts, prompt for prompt (JSON between the processes)."""

    prompts: list[list[int]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)  # dataset, index, question_id, turn per prompt
    vanilla: list[list[int]] = field(default_factory=list)  # the engine's answers without a draft
    vanilla_s: dict[str, float] = field(default_factory=dict)  # per dataset
    # per draft name: the engine's answers with it, and per dataset its seconds and vLLM's spec_decode counters
    spec: dict[str, list[list[int]]] = field(default_factory=dict)
    spec_s: dict[str, dict[str, float]] = field(default_factory=dict)
    counters: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # name, version, max_model_len
    # "vanilla" or a draft name -> per dataset the machine's 1-minute load average after each of its timed
    # generate calls (the load its tokens/s were measured under)
    load_1m: dict[str, dict[str, list[float]]] = field(default_factory=dict)
