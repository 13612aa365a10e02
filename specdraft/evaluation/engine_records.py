"""What crosses between the driver and the engine process (``engine_process``) of the engine measurement
(docs/evaluation.md): the request — target, exported drafts, questions, engine
and sampling settings — and the engine's answers and counters, prompt for prompt. Plain JSON both ways.

``vanilla_timing`` reads the target alone's tokens/s from a run — each of its passes (before the first drafter and,
with ``engine.vanilla_passes: 2``, again after the last) and both combined, the one every engine speedup divides by —
and ``vanilla_warnings`` says when the two passes disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VANILLA_AGAIN = "vanilla_again"  # the second vanilla pass's name (``EngineRun.load_1m``, its progress lines)


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
    # the target alone again after the last drafter, on exactly ``prompts`` (``engine.vanilla_passes: 2``; empty
    # with one pass): its answers and per dataset its seconds; its loads are ``load_1m[VANILLA_AGAIN]``
    vanilla_again: list[list[int]] = field(default_factory=list)
    vanilla_again_s: dict[str, float] = field(default_factory=dict)
    # per draft name: the engine's answers with it, and per dataset its seconds and vLLM's spec_decode counters
    spec: dict[str, list[list[int]]] = field(default_factory=dict)
    spec_s: dict[str, dict[str, float]] = field(default_factory=dict)
    counters: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # name, version, max_model_len
    # "vanilla", VANILLA_AGAIN or a draft name -> per dataset the machine's 1-minute load average after each of its
    # timed generate calls (the load its tokens/s were measured under)
    load_1m: dict[str, dict[str, list[float]]] = field(default_factory=dict)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


VANILLA_KEYS = ("tokens_per_s_vanilla", "tokens_per_s_vanilla_passes", "vanilla_drift", "load_1m_vanilla",
                "load_1m_vanilla_passes", "vanilla_changed")  # ``vanilla_timing``'s keys


def vanilla_timing(run: EngineRun, names: list[str] | None = None) -> dict[str, Any]:
    """The target alone over the datasets ``names`` (None: all): each pass's tokens/s and mean load (the pass
    before the drafters, then the one after them when there is one), both passes combined (total tokens over
    total seconds: the tokens/s every engine speedup divides by; their loads' mean), the drift (second pass's
    tokens/s over the first's - 1; None with one pass) and how many prompts the second pass answered differently
    from the first (None with one pass)."""
    names = list(names) if names is not None else list(dict.fromkeys(t["dataset"] for t in run.turns))
    rows = [i for i, t in enumerate(run.turns) if t["dataset"] in names]
    passes = [(run.vanilla, run.vanilla_s, "vanilla")]
    if run.vanilla_again_s:
        passes.append((run.vanilla_again, run.vanilla_again_s, VANILLA_AGAIN))
    tokens = [sum(len(answers[i]) for i in rows) for answers, _, _ in passes]
    seconds = [sum(timed[n] for n in names) for _, timed, _ in passes]
    loads = [[x for n in names for x in run.load_1m.get(key, {}).get(n, [])] for _, _, key in passes]
    rates = [t / s if s else None for t, s in zip(tokens, seconds)]
    two = len(passes) == 2
    return {
        "tokens_per_s_vanilla": sum(tokens) / sum(seconds) if sum(seconds) else None,  # both passes combined
        "tokens_per_s_vanilla_passes": rates,  # each pass's: [before the drafters, after them]
        "vanilla_drift": rates[1] / rates[0] - 1 if two and rates[0] and rates[1] is not None else None,
        "load_1m_vanilla": _mean([x for pass_loads in loads for x in pass_loads]),
        "load_1m_vanilla_passes": [_mean(pass_loads) for pass_loads in loads],
        "vanilla_changed": sum(run.vanilla_again[i] != run.vanilla[i] for i in rows) if two else None,
    }


def vanilla_warnings(timing: dict[str, Any], prompts: int, drift_warn: float, greedy: bool) -> list[str]:
    """Lines for a report's warnings from ``vanilla_timing``'s ``timing`` over ``prompts`` prompts: a drift above
    ``drift_warn`` (``engine.vanilla_drift_warn``) and any prompt the second pass answered differently."""
    out = []
    drift = timing["vanilla_drift"]
    if drift is not None and abs(drift) > drift_warn:
        first, second = timing["tokens_per_s_vanilla_passes"]
        out.append(f"vanilla ran at {first:.1f} tokens/s before the drafters and {second:.1f} after them "
                   f"(drift {100 * drift:+.0f}%, more than {100 * drift_warn:.0f}%): the machine's speed moved during "
                   f"the measurement, so every engine speedup is uncertain by about {100 * abs(drift):.0f}%")
    if timing["vanilla_changed"]:
        out.append(f"vanilla's second pass answered {timing['vanilla_changed']} of {prompts} prompts differently "
                   f"from its first" + (" (greedy: they should be equal)" if greedy else " (sampled)"))
    return out
