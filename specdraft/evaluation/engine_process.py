"""The engine process of the engine measurement: vLLM serving the target alone, then with each exported
draft, on the same prompts ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §5
defines the acceptance length our decoder reports; vLLM reports its own counters).

Run as ``python -m specdraft.evaluation.engine_process REQUEST RESULT`` by ``engine.measure_engine``, so
vLLM's global state — its engine processes, thread binding, Prometheus counters — stays out of the caller:

* vanilla: the target alone, turn by turn over the question sets (each turn's prompt holds the earlier
  turns' answers), giving every prompt and the engine's plain tokens/s;
* speculative: the target with each draft (chain of K, vLLM's only draft shape), on exactly those prompts:
  tokens/s and vLLM's counters — drafts, drafted tokens, accepted tokens, accepted per position;
* vanilla again (``engine.vanilla_passes: 2``): the target alone on exactly those prompts after the last draft, its
  answers and seconds beside the first pass's (``EngineRun.vanilla_again``): the engine's speedups divide by both
  passes' tokens/s, so a machine whose speed moved during the measurement shows, instead of inflating them.

Progress: the prompts are generated a few at a time (``CHUNK``; batch 1 in the engine either way) and a
``specdraft.progress`` line written to the file descriptor ``PROGRESS_FD`` names (a pipe ``measure_engine``
relays to the user; stderr without one), while vLLM's own output goes wherever the process's stdout and
stderr go (``measure_engine``: the engine's log file).

All are timed in this one process, one after the other (one engine in memory at a time: a GPU holds one), never
read from an earlier run; the load average after each timed call is kept beside the times (``EngineRun.load_1m``).

This module is the engine process's entry point alone: it imports vLLM at its top (nothing else in
specdraft imports it but the plugin).
"""

from __future__ import annotations

import gc
import json
from contextlib import contextmanager
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from specdraft.decoding.speculative import eos_token_ids
from specdraft.evaluation.engine_records import VANILLA_AGAIN, EngineRequest, EngineRun
from specdraft.export.commands import cpu_engine_args, cuda_host
from specdraft.evaluation.questions import answer_text, render_prompt
from specdraft.evaluation.records import load_1m
from specdraft.configs.evaluation import EngineSettings
from specdraft.progress import ProgressLines
from specdraft.targets.loading import load_tokenizer

METRIC = "vllm:spec_decode_"
PROGRESS_FD = "SPECDRAFT_PROGRESS_FD"  # the environment variable naming the progress lines' file descriptor
CHUNK = 4  # prompts per generate call: a progress line can follow any call


def _llm(request: EngineRequest, settings: EngineSettings, draft: dict[str, str] | None):
    with _llvmlite_hidden():
        return _start(request, settings, draft)


LLVMLITE_FFI = "llvmlite.binding.ffi"


@contextmanager
def _llvmlite_hidden():
    """vLLM 0.32's worker start scans every loaded module's namespace (``triton_utils.dispatcher._rebind_kernels``)
    and fails on llvmlite's library wrapper (``llvmlite.binding.ffi.lib``: ``vars()`` of it is no dict) once numba
    is loaded — which vLLM's ngram proposer does: every engine started after an ngram engine in this process failed
    (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``). That module is out of ``sys.modules``
    while an engine starts (the modules holding it keep their reference) and back after."""
    module = sys.modules.pop(LLVMLITE_FFI, None)
    try:
        yield
    finally:
        if module is not None:
            sys.modules[LLVMLITE_FFI] = module


def _start(request: EngineRequest, settings: EngineSettings, draft: dict[str, str] | None):
    cpu = not cuda_host()
    dtype = settings.dtype if settings.dtype != "auto" else ("float32" if cpu else "auto")
    kwargs = cpu_engine_args(settings.cpu_kvcache_gib) if cpu else {}  # as the printed serve commands
    if settings.enforce_eager is not None:
        kwargs["enforce_eager"] = settings.enforce_eager
    if draft is not None:
        # a drafter's own K (the sweep's ``num_speculative_tokens``) wins over the settings'
        kwargs["speculative_config"] = {"num_speculative_tokens": settings.speculative_tokens, **draft}
    if settings.tensor_parallel_size == 1:
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(model=request.target, tokenizer=request.target, dtype=dtype, max_model_len=settings.max_model_len,
               tensor_parallel_size=settings.tensor_parallel_size, trust_remote_code=False, seed=request.seed,
               disable_log_stats=False,  # the spec_decode counters
               max_num_seqs=1, enable_prefix_caching=False,  # batch 1, as our decoder; no cache carried over
               gpu_memory_utilization=settings.gpu_memory_utilization, **kwargs)


def _counters(llm) -> dict[str, Any]:
    """vLLM's speculative-decoding counters (summed over label sets: one per engine)."""
    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(METRIC):
            continue
        key = metric.name[len(METRIC):]
        if type(metric).__name__ == "Vector":
            prev = out.get(key, [0] * len(metric.values))
            out[key] = [a + b for a, b in zip(prev, metric.values)]
        elif type(metric).__name__ == "Counter":
            out[key] = out.get(key, 0) + metric.value
    return out


def _generate(llm, prompts: list[list[int]], params, lines: ProgressLines) -> tuple[list[list[int]], float]:
    """The answers to ``prompts`` (``CHUNK`` per call, each counted in ``lines``) and the seconds they took."""
    answers, seconds = [], 0.0
    for i in range(0, len(prompts), CHUNK):
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + CHUNK]], params,
                               use_tqdm=False)
        seconds += time.perf_counter() - start
        answers += [list(o.outputs[0].token_ids) for o in outputs]
        lines.update(len(outputs), sum(len(a) for a in answers[-len(outputs):]))
    return answers, seconds


def _progress_stream():
    fd = os.environ.get(PROGRESS_FD)
    if not fd:
        return sys.stderr
    os.set_inheritable(int(fd), False)  # the pipe ends with this process, not with a program it starts
    return os.fdopen(int(fd), "w", buffering=1)


def _note_load(run: EngineRun, measured: str, dataset: str) -> None:
    load = load_1m()
    if load is not None:
        run.load_1m.setdefault(measured, {}).setdefault(dataset, []).append(load)


def run_engine(request: EngineRequest) -> EngineRun:
    """The engine process: vanilla turn by turn (building the prompts), then each draft on the same prompts, then
    (``engine.vanilla_passes: 2``) vanilla again on them: the machine's speed at both ends of the measurement."""
    settings = EngineSettings(**request.settings)
    params = SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k or -1,
                            max_tokens=request.max_new_tokens, seed=request.seed, skip_special_tokens=True)
    run = EngineRun(engine={"name": "vllm", "version": vllm.__version__, "max_model_len": settings.max_model_len})
    stream = _progress_stream()
    llm = _announced(request, settings, None, "the target alone", stream)
    _vanilla(llm, request, params, run, stream)
    for draft, spec in request.drafts.items():
        llm = None  # one engine in memory at a time
        gc.collect()
        llm = _announced(request, settings, spec, f"the draft {draft}", stream)
        run.spec[draft], run.spec_s[draft], run.counters[draft] = _timed(llm, run, draft, params, stream)
    if settings.vanilla_passes == 2:
        llm = None
        gc.collect()
        llm = _announced(request, settings, None, "the target alone again", stream)
        run.vanilla_again, run.vanilla_again_s, _ = _timed(llm, run, VANILLA_AGAIN, params, stream)
    return run


def _announced(request: EngineRequest, settings: EngineSettings, draft: dict[str, Any] | None, what: str, stream):
    print(f"[specdraft] engine: starting vLLM with {what}", file=stream, flush=True)
    return _llm(request, settings, draft)


def _vanilla(llm, request: EngineRequest, params, run: EngineRun, stream) -> None:
    """The target alone, turn by turn, each dataset timed on its own: each turn's prompt holds the earlier turns'
    answers. Fills ``run``'s prompts, turns, vanilla answers and seconds."""
    tokenizer = load_tokenizer(request.target)
    eos = eos_token_ids(None, tokenizer)
    lines = ProgressLines("engine vanilla", sum(len(q["turns"]) for q in request.questions), "prompts", stream=stream)
    for dataset in dict.fromkeys(q["dataset"] for q in request.questions):  # timed per dataset
        questions = [q for q in request.questions if q["dataset"] == dataset]
        history = {q["index"]: [{"role": "system", "content": request.system_prompt}] if request.system_prompt else []
                   for q in questions}
        run.vanilla_s[dataset] = 0.0
        for turn in range(1, max(len(q["turns"]) for q in questions) + 1):
            asked = [q for q in questions if len(q["turns"]) >= turn]
            prompts = []
            for q in asked:
                history[q["index"]].append({"role": "user", "content": q["turns"][turn - 1]})
                prompts.append(render_prompt(tokenizer, history[q["index"]]))
            answers, seconds = _generate(llm, prompts, params, lines)
            run.vanilla_s[dataset] += seconds
            _note_load(run, "vanilla", dataset)
            for q, prompt, answer in zip(asked, prompts, answers):
                history[q["index"]].append({"role": "assistant", "content": answer_text(tokenizer, answer, eos)})
                run.prompts.append(prompt)
                run.vanilla.append(answer)
                run.turns.append({"dataset": dataset, "index": q["index"], "question_id": q["question_id"],
                                  "turn": turn})


def _timed(llm, run: EngineRun, name: str, params, stream
           ) -> tuple[list[list[int]], dict[str, float], dict[str, dict[str, Any]]]:
    """``run.prompts`` answered by ``llm`` (a drafter ``name``, or the target alone again), one dataset at a time:
    the answers, per dataset the seconds and vLLM's spec_decode counters (its own per dataset)."""
    lines = ProgressLines(f"engine {name}", len(run.prompts), "prompts", stream=stream)
    answers, seconds, counters = [[] for _ in run.prompts], {}, {}
    for dataset in dict.fromkeys(t["dataset"] for t in run.turns):
        rows = [i for i, t in enumerate(run.turns) if t["dataset"] == dataset]
        before = _counters(llm)
        out, seconds[dataset] = _generate(llm, [run.prompts[i] for i in rows], params, lines)
        _note_load(run, name, dataset)
        after = _counters(llm)
        for i, answer in zip(rows, out):
            answers[i] = answer
        counters[dataset] = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list)
                                 else v - before.get(k, 0)) for k, v in after.items()}
    return answers, seconds, counters


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = (argv or sys.argv[1:])[:2]
    run = run_engine(EngineRequest(**json.loads(Path(request_path).read_text())))
    Path(result_path).write_text(json.dumps(asdict(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
