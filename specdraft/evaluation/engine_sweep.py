"""K chosen by the engine, and the cost model shown (docs/evaluation.md, "K chosen by the engine").

The engine measurement times vLLM with the draft and with vLLM's own ``ngram`` prompt lookup at every K of
``engine.sweep_k`` (one run: ``engine_process`` starts the engine once per drafter and K, after the target alone).
This module reads those timings: per K the acceptance length τ (tokens per verification round), tokens/s and the
engine's speedup over the target alone; each drafter's fastest K (``best_k``); and the cost model of "Fast Inference
from Transformers via Speculative Decoding" (Leviathan et al., 2023, Theorem 3.8):

    speedup ≈ τ / (v + K·c)

with ``c`` the draft step's cost over a target step and ``v`` the verify step's. A round of K drafts emits τ tokens
in τ / speedup target-token times, so ``τ_K / speedup_K`` measured at two or more K is a line in K: its slope is ``c``
and its intercept ``v`` (``fit_cost``, least squares). From them: the acceptance a draft would need at its best K
for a speedup (``needed_tau``: 1.3×, and ngram's best speedup), and the same as a per-token acceptance rate α with
τ = (1 - α^(K+1)) / (1 - α) (``alpha_for_tau``, the same theorem's i.i.d. model). A draft whose τ is below what it
needs at its c is too weak; one whose need is above K + 1 (every draft accepted) at its c is too costly.

Every speedup divides by vanilla's tokens/s over its two passes, one before the first drafter and one after the last
(``engine.vanilla_passes``; ``engine_records.vanilla_timing``): a machine whose speed moves during the sweep moves
both, and their drift is shown (``vanilla_line``) and warned about above ``engine.vanilla_drift_warn``.

Pure functions over numbers, except ``sweep_report`` (an ``EngineRun`` in), ``sweep_summary`` (the table's lines)
and ``sweep_note`` (the run summary's one line). Importing it imports no torch.
"""

from __future__ import annotations

from typing import Any

from specdraft.configs.evaluation import VANILLA_DRIFT_WARN
from specdraft.evaluation.engine_records import EngineRun, vanilla_timing, vanilla_warnings

TARGET_SPEEDUP = 1.3  # the speedup a draft is asked what acceptance it needs for (issue 40's goal)
DRAFTERS = ("draft", "ngram")
NGRAMS = "ngram's"


def sweep_name(drafter: str, k: int) -> str:
    """The engine request's name of ``drafter`` ("draft" or "ngram") served at K = ``k``."""
    return f"{drafter}@k{k}"


def best_k(speeds: dict[int, float | None]) -> int | None:
    """The K with the most tokens/s (or speedup: one vanilla for all); a tie goes to the smaller K (fewer drafted
    tokens for the same speed); None when no K was measured."""
    measured = [(k, s) for k, s in speeds.items() if s is not None]
    if not measured:
        return None
    top = max(s for _, s in measured)
    return min(k for k, s in measured if s == top)


def fit_cost(points: list[tuple[int, float, float]]) -> tuple[float, float] | None:
    """(c, v) from (K, τ, speedup) points: the least-squares line through (K, τ / speedup); None with fewer than two
    distinct K measured (a line needs two); a point without a positive speedup or a τ is left out."""
    rows = [(k, tau / speedup) for k, tau, speedup in points if tau is not None and speedup]
    if len({k for k, _ in rows}) < 2:
        return None
    n = len(rows)
    mean_k = sum(k for k, _ in rows) / n
    mean_r = sum(r for _, r in rows) / n
    c = sum((k - mean_k) * (r - mean_r) for k, r in rows) / sum((k - mean_k) ** 2 for k, _ in rows)
    return c, mean_r - c * mean_k


def needed_tau(speedup: float, k: int, c: float, v: float) -> float:
    """The acceptance length (tokens per round) a draft of costs ``c``, ``v`` needs at K = ``k`` for ``speedup``."""
    return speedup * (v + k * c)


def tau_for_alpha(alpha: float, k: int) -> float:
    """Tokens per round of K drafts each accepted with probability α until the first rejection (plus the target's
    own token): (1 - α^(K+1)) / (1 - α)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def alpha_for_tau(tau: float, k: int) -> float | None:
    """The per-token acceptance rate α whose ``tau_for_alpha`` is ``tau`` (bisection: it rises with α); None when
    ``tau`` is above K + 1, which no draft reaches; 0 at or below 1."""
    if tau > k + 1:
        return None
    if tau <= 1:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tau_for_alpha(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def _needs(speedup: float | None, k: int, c: float, v: float) -> dict[str, Any] | None:
    if speedup is None:
        return None
    tau = needed_tau(speedup, k, c, v)
    return {"speedup": speedup, "tau": tau, "alpha": alpha_for_tau(tau, k), "reachable": tau <= k + 1}


def cost_model(rows: dict[int, dict[str, Any]], k: int | None, ngram_speedup: float | None) -> dict[str, Any]:
    """A drafter's c and v (``fit_cost`` over its K, overall numbers) and, at its best K ``k``, the τ and α it
    would need for ``TARGET_SPEEDUP`` and for ``ngram_speedup`` (None: no ngram measured); its τ there beside them."""
    fit = fit_cost([(key, r["acceptance_length"], r["speedup"]) for key, r in sorted(rows.items())])
    out: dict[str, Any] = {"c": None, "v": None, "k": k, "tau": rows[k]["acceptance_length"] if k else None,
                           "for_target": None, "for_ngram": None, "target_speedup": TARGET_SPEEDUP}
    if fit is None or k is None:
        return out
    c, v = fit
    return {**out, "c": c, "v": v, "for_target": _needs(TARGET_SPEEDUP, k, c, v),
            "for_ngram": _needs(ngram_speedup, k, c, v)}


def sweep_report(run: EngineRun, ks: dict[str, list[int]], greedy: bool,
                 drift_warn: float = VANILLA_DRIFT_WARN) -> dict[str, Any]:
    """The sweep of ``run``: per drafter in ``ks`` (name -> the K it was served at; ``sweep_name``) and per K the
    engine's numbers (``engine_only``: speedups over vanilla's two passes combined), its best K, and each drafter's
    cost model (every draft's beside ngram's best speedup: several drafts may share a run,
    ``benchmarks/draft_vocab.py``); vanilla's tokens/s and load, each pass's and combined (``vanilla_timing``), and
    ``warnings``: a drift between its passes above ``drift_warn``, answers its second pass changed."""
    from specdraft.evaluation.engine_comparison import engine_only  # torch: only where a run is read
    out: dict[str, Any] = {"k": sorted({k for v in ks.values() for k in v}), "best_k": {}, "best_speedup": {}}
    for drafter, measured in ks.items():
        rows = {}
        for k in measured:
            report = engine_only(run, sweep_name(drafter, k), k, greedy)
            rows[k] = {**report["overall"], "datasets": report["datasets"]}
        out[drafter] = {str(k): row for k, row in rows.items()}
        out["best_k"][drafter] = best_k({k: r["tokens_per_s"] for k, r in rows.items()})
        out["best_speedup"][drafter] = rows[out["best_k"][drafter]]["speedup"] if out["best_k"][drafter] else None
    vanilla = vanilla_timing(run)
    out.update(vanilla)
    out["warnings"] = vanilla_warnings(vanilla, len(run.turns), drift_warn, greedy)
    out["cost"] = {drafter: cost_model({int(k): r for k, r in out[drafter].items()}, out["best_k"][drafter],
                                       out["best_speedup"].get("ngram") if drafter != "ngram" else None)
                   for drafter in ks}
    return out


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def sweep_summary(sweep: dict[str, Any]) -> list[str]:
    """The sweep as lines: one row per K (each drafter's acceptance, tokens/s and speedup), vanilla's tokens/s, each
    drafter's best K and the draft's cost model with the acceptance it needs."""
    drafters = [d for d in DRAFTERS if d in sweep]
    cell = "| {:<6}{:>11} {:>7} {:>7} {:>5} "
    lines = [f"  engine by K ({vanilla_line(sweep)}):",
             "  K " + "".join(cell.format(d, "acceptance", "tok/s", "speedup", "load") for d in drafters).rstrip()]
    for k in sweep["k"]:
        cells = []
        for d in drafters:
            r = sweep[d].get(str(k))
            cells.append(cell.format("", "not served", "", "", "") if r is None else
                         cell.format("", _f(r["acceptance_length"]), _f(r["tokens_per_s"], ".1f"), _f(r["speedup"]),
                                     _f(r["load_1m"])))
        lines.append(f"  {k} " + "".join(cells).rstrip())
    best = ", ".join(f"{d} K={sweep['best_k'][d]} ({_f(sweep['best_speedup'][d])}x)" for d in drafters)
    lines.append(f"  fastest: {best}")
    cost = sweep["cost"].get("draft")
    if cost is not None:
        lines.append("  " + cost_line(cost))
    return lines


def vanilla_line(sweep: dict[str, Any]) -> str:
    """Vanilla's tokens/s and load: each pass's, their drift and the combined tokens/s the speedups divide by (one
    pass, or a sweep from before there were two: its tokens/s and load)."""
    rates, loads = sweep.get("tokens_per_s_vanilla_passes"), sweep.get("load_1m_vanilla_passes")
    if not rates or len(rates) < 2:
        return f"vanilla {_f(sweep['tokens_per_s_vanilla'], '.1f')} tokens/s, load {_f(sweep['load_1m_vanilla'])}"
    drift = sweep["vanilla_drift"]
    return (f"vanilla {_f(rates[0], '.1f')} / {_f(rates[1], '.1f')} tokens/s before / after the drafters, drift "
            f"{'n/a' if drift is None else format(100 * drift, '+.0f')} %, load {_f(loads[0])} / {_f(loads[1])}; "
            f"speedups over both: {_f(sweep['tokens_per_s_vanilla'], '.1f')} tokens/s")


def cost_line(cost: dict[str, Any]) -> str:
    """One line: the draft's c and v, and the acceptance it has and needs at its best K."""
    if cost["c"] is None:
        return "cost model: not fitted (fewer than two K measured with a speedup)"
    k = cost["k"]

    def need(n: dict[str, Any] | None, label: str) -> str:
        if n is None:
            return f"n/a for {label}"
        if not n["reachable"]:
            return f"τ {n['tau']:.2f} for {label} {n['speedup']:.2f}x (above K+1 = {k + 1}: unreachable at this cost)"
        return f"τ {n['tau']:.2f} (α {n['alpha']:.2f}) for {label} {n['speedup']:.2f}x"

    verdict = ""
    if cost["for_target"] is not None and cost["tau"] is not None:
        verdict = ("; too costly: no acceptance reaches it" if not cost["for_target"]["reachable"] else
                   "; too weak: its acceptance is below what it needs" if cost["tau"] < cost["for_target"]["tau"]
                   else "")
    return (f"cost model (speedup ≈ τ / (v + K·c)): c {cost['c']:.3f}, v {cost['v']:.3f}; at K={k} the draft has "
            f"τ {_f(cost['tau'])}, needs {need(cost['for_target'], 'a speedup of')}, "
            f"{need(cost['for_ngram'], NGRAMS)}{verdict}")


def sweep_note(sweep: dict[str, Any]) -> str:
    """The run summary's line: each drafter's fastest K in the engine and its speedup, and the draft's cost model."""
    best = ", ".join(f"{'vLLM ngram' if d == 'ngram' else d} K={sweep['best_k'][d]} "
                     f"({_f(sweep['best_speedup'][d])}x)" for d in DRAFTERS if d in sweep)
    cost = sweep["cost"].get("draft")
    warned = "".join(f"; warning: {w}" for w in sweep.get("warnings") or [])  # vanilla's passes disagree
    return f"engine fastest: {best}" + (f"; {cost_line(cost)}" if cost is not None else "") + warned
