"""Engine-measured evaluation: the target served by vLLM with an exported draft, beside our own decoder.

The engine is the judge of a draft ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees" §5 defines the acceptance length our decoder reports; vLLM reports its own). ``engine_report``
exports the draft, ``measure_engine`` runs the engine in a child process (``engine_process``: vLLM's
global state stays out of the caller) and ``engine_comparison.compare`` puts our decoder's count beside
the engine's. Mean acceptance length = 1 + accepted / drafts (SGLang's τ: tokens per verification).

Settings (``specdraft.configs.evaluation.EngineSettings``, ``eval.engine`` in a run config) pass straight to
``vllm.LLM``; the engine's context ``max_model_len`` is the target's own unless set
(``specdraft.preflight.engine_model_len``, which refuses a value above it).

vLLM's own ``ngram`` prompt lookup is one more drafter of a request (``ngram_drafter``: our prompt-lookup floor's
n-gram range, ``specdraft.decoding.prompt_lookup``), reported by ``engine_comparison.engine_only``: the floor in
the engine. The draft and ngram are each served at every K of ``engine.sweep_k`` in the same run, K by K after the
target alone and (``engine.vanilla_passes: 2``) before it again (``engine_sweep``: the table, each one's fastest K and
the draft's cost model, the report's ``sweep``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from specdraft.config import ConfigError
from specdraft.configs.decode import PromptLookupConfig
from specdraft.configs.evaluation import EvalSettings
from specdraft.evaluation.engine_comparison import compare
from specdraft.evaluation.engine_records import EngineRequest, EngineRun
from specdraft.evaluation.engine_sweep import sweep_name, sweep_report, sweep_summary
from specdraft.evaluation.models import Models, load_models
from specdraft.evaluation.questions import load_question_sets
from specdraft.export import VLLM_FORMATS, export_draft, export_layout, formats_for
from specdraft.models import read_draft_config
from specdraft.preflight import engine_model_len, target_positions
from specdraft.configs.evaluation import EngineSettings


def ngram_drafter(pld: PromptLookupConfig | None = None) -> dict[str, Any]:
    """vLLM's ``ngram`` prompt-lookup drafter as an ``EngineRequest.drafts`` entry, matching suffixes of
    ``pld.min_ngram`` .. ``pld.max_ngram`` tokens like our floor (its K: the engine's ``speculative_tokens``)."""
    pld = pld or PromptLookupConfig()
    return {"method": "ngram", "prompt_lookup_max": pld.max_ngram, "prompt_lookup_min": pld.min_ngram}


def measure_engine(request: EngineRequest, settings: EngineSettings, log: str | Path | None = None,
                   progress: bool = False) -> EngineRun:
    """Run ``request`` in a vLLM child process and return its answers and counters. The engine's context is
    resolved here, once (``engine_model_len``: the target's unless set; above it, a ``ConfigError``).

    vLLM's own output (its INFO lines, warnings) goes to the file ``log`` (None: a temporary one), its tail into
    the error when the engine fails; with ``progress`` the engine's progress lines (``engine_process``) are
    printed here, after one line naming ``log``."""
    settings = replace(settings, max_model_len=engine_model_len(settings, target_positions(request.target)))
    request = replace(request, settings=asdict(settings))
    with tempfile.TemporaryDirectory(prefix="specdraft-engine-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        kept = f"; its log: {log}" if log is not None else ""
        log = Path(log) if log is not None else Path(tmp) / "engine.log"
        req.write_text(json.dumps(asdict(request)))
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        if settings.tensor_parallel_size == 1:  # one process: no engine-core and worker processes to start
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if progress:
            print(f"[specdraft] engine: vLLM's own output goes to {log}", flush=True)
        code = run_logged([sys.executable, "-m", "specdraft.evaluation.engine_process", str(req), str(res)], env,
                           log, settings.timeout_s, sys.stdout if progress else None)
        if code is None:
            raise RuntimeError(f"the vLLM engine did not finish within {settings.timeout_s:.0f} s{kept}")
        if code != 0 or not res.is_file():
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-25:])
            raise RuntimeError(f"the vLLM engine failed (exit {code}{kept}):\n{tail}")
        return EngineRun(**json.loads(res.read_text()))


def run_logged(command: list[str], env: dict[str, str], log: Path, timeout_s: float, relay) -> int | None:
    """Run ``command`` with its stdout and stderr in ``log`` and the lines it writes to the descriptor
    ``engine_process.PROGRESS_FD`` names relayed to ``relay`` (None: dropped); its exit status, None when it was
    killed after ``timeout_s``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    read, write = os.pipe()
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, env={**env, "SPECDRAFT_PROGRESS_FD": str(write)}, stdout=out,
                                stderr=subprocess.STDOUT, pass_fds=(write,))
    os.close(write)
    fired = threading.Event()

    def kill() -> None:
        fired.set()
        proc.kill()

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        with os.fdopen(read, encoding="utf-8", errors="replace") as lines:
            for line in lines:  # until the process (and any child holding the pipe) is gone
                if relay is not None:
                    print(line.rstrip("\n"), file=relay, flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return None if fired.is_set() else code


def engine_report(target: str | Path, draft: str | Path, question_files: list[str | Path], settings: EvalSettings,
                  models: Models | None = None, log: str | Path | None = None, progress: bool = False
                  ) -> dict[str, Any]:
    """Export ``draft`` for vLLM, serve it with ``target`` on the questions (``settings.engine`` says how) and
    compare with our decoder (``models``: already loaded, or loaded here); ``log`` and ``progress`` as
    ``measure_engine``'s (``progress``: our decoder's progress on the engine's prompts too)."""
    engine = settings.engine
    config = read_draft_config(draft)
    fmt = next((f for f in formats_for(config) if f in VLLM_FORMATS), None)
    if fmt is None:
        raise ConfigError(f"{draft}: no vLLM format serves this draft ({formats_for(config)})")
    questions = load_question_sets(question_files, settings.max_questions, allow_empty=settings.allow_empty)
    with tempfile.TemporaryDirectory(prefix="specdraft-engine-export-") as tmp:
        out = export_draft(draft, fmt, Path(tmp) / fmt, target=target, speculative_tokens=engine.speculative_tokens)
        ks = sweep_ks(engine, config.block_size - 1 if config.drafts_blocks else None)
        served = {"model": str(out), "method": export_layout(fmt, out).method}
        drafts = {sweep_name(drafter, k): {**(served if drafter == "draft" else ngram_drafter(settings.pld)),
                                           "num_speculative_tokens": k}
                  for k in engine.measured_k for drafter in ks if k in ks[drafter]}  # interleaved: K by K
        decode = settings.decode
        request = EngineRequest(target=str(Path(target).resolve()), drafts=drafts,
                                questions=questions, settings=asdict(engine), temperature=decode.temperature,
                                top_p=decode.top_p, top_k=decode.top_k, max_new_tokens=decode.max_new_tokens,
                                seed=settings.seed, system_prompt=settings.system_prompt)
        run = measure_engine(request, engine, log, progress)
    models = models if models is not None else load_models(target, draft, settings)
    compared = compare(run, sweep_name("draft", engine.speculative_tokens), models, settings.decode, engine, progress)
    sweep = sweep_report(run, ks, compared["greedy"], engine.vanilla_drift_warn)
    # the report's warnings: our decoder's gaps, then vanilla's passes disagreeing (the sweep's own, kept there too)
    return {"format": fmt, **compared, "warnings": compared["warnings"] + sweep["warnings"], "sweep": sweep}


def sweep_ks(engine: EngineSettings, max_k: int | None = None) -> dict[str, list[int]]:
    """The K each drafter is served at: the draft at every ``engine.measured_k`` up to ``max_k`` (a block draft's
    block size - 1; None: no bound) — its ``speculative_tokens`` always —, vLLM's ngram at every one
    (``engine.ngram``)."""
    draft = [k for k in engine.measured_k if max_k is None or k <= max_k or k == engine.speculative_tokens]
    return {"draft": draft, **({"ngram": list(engine.measured_k)} if engine.ngram else {})}


def engine_summary(report: dict[str, Any]) -> str:
    """The engine's lines of an eval report: per dataset its acceptance length beside ours, and its speedup."""
    fmt = lambda x, spec=".3f": "n/a" if x is None else format(x, spec)  # noqa: E731
    engine = report["engine"]
    lines = [f"engine {engine['name']} {engine['version']} ({report['format']} export, chain K="
             f"{report['speculative_tokens']}):"]
    for name, d in {**report["datasets"], "overall": report["overall"]}.items():
        pos = ", ".join(fmt(a, ".2f") for a in d["accepted_per_pos"])
        lines.append(f"  {name}: acceptance length {fmt(d['acceptance_length'])} vs ours {fmt(d['tau_ours'])} "
                     f"(gap {fmt(None if d['gap'] is None else 100 * d['gap'], '+.1f')}%), accepted per position "
                     f"[{pos}], {fmt(d['tokens_per_s'], '.1f')} tokens/s vs {fmt(d['tokens_per_s_vanilla'], '.1f')} "
                     f"without the draft (engine speedup {fmt(d['speedup'], '.2f')}, both timed in this run, load "
                     f"{fmt(d.get('load_1m'), '.2f')} / {fmt(d.get('load_1m_vanilla'), '.2f')} without)")
    lines += sweep_summary(report["sweep"]) if report.get("sweep") else []
    lines += [f"  warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)
