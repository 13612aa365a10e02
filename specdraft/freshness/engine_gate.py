"""The champion gate's engine rule: with a serving engine configured, a draft is promoted only
if the engine serves it faster than without a draft (speedup > 1) AND faster than the engine's own ``ngram`` prompt
lookup, each at its fastest K (``specdraft.evaluation.engine_sweep``: the eval report's ``engine.sweep``).

A pure function over numbers; ``pipelines.registry.register_draft`` applies it beside the floor and the champion
comparison (its ``engine`` argument), and its reason joins the decision's. Equal speeds fail: a draft must be faster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineVerdict:
    passed: bool
    reason: str
    draft_k: int | None = None
    draft_speedup: float | None = None  # the draft's at its fastest K (tokens/s over the engine's own without one)
    ngram_k: int | None = None
    ngram_speedup: float | None = None  # vLLM's ngram at its fastest K; None: not measured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def best_of(sweep: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each drafter's fastest K and its speedup from an eval report's ``engine.sweep`` (``{}``: no sweep)."""
    if not sweep:
        return {}
    return {d: {"k": k, "speedup": sweep["best_speedup"].get(d)} for d, k in sweep["best_k"].items()}


def engine_verdict(best: dict[str, dict[str, Any]] | None) -> EngineVerdict | None:
    """``best``: ``best_of``'s drafter -> {"k", "speedup"}. None when no engine measured the draft (no ``best``):
    the gate stands as without an engine. The draft passes when its speedup at its fastest K is above 1 and above
    ngram's at ngram's fastest K (ngram not measured: above 1 alone, and the reason says so)."""
    if not best:
        return None
    draft, ngram = best.get("draft") or {}, best.get("ngram") or {}
    k, speedup = draft.get("k"), draft.get("speedup")
    n_k, n_speedup = ngram.get("k"), ngram.get("speedup")
    facts = dict(draft_k=k, draft_speedup=speedup, ngram_k=n_k, ngram_speedup=n_speedup)
    if speedup is None:
        return EngineVerdict(passed=False, reason="engine: the draft's speed was not measured, not promoted", **facts)
    vanilla_ok = speedup > 1
    parts = [f"engine speedup {speedup:.3f}x at K={k} vs 1 without a draft (needs > 1): "
             f"{'pass' if vanilla_ok else 'FAIL'}"]
    if n_speedup is None:
        ngram_ok = True
        parts.append("vLLM's ngram not measured (engine.ngram=false): not compared")
    else:
        ngram_ok = speedup > n_speedup
        parts.append(f"vs vLLM's ngram {n_speedup:.3f}x at K={n_k} (needs >): {'pass' if ngram_ok else 'FAIL'}")
    return EngineVerdict(passed=vanilla_ok and ngram_ok, reason="; ".join(parts), **facts)
