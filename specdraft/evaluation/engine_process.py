"""The engine process of the engine measurement: vLLM serving the target alone, then with each exported
draft, on the same prompts ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §5
defines the acceptance length our decoder reports; vLLM reports its own counters).

Run as ``python -m specdraft.evaluation.engine_process REQUEST RESULT`` by ``engine.measure_engine``, so
vLLM's global state — its engine processes, thread binding, Prometheus counters — stays out of the caller:

* vanilla: the target alone, turn by turn over the question sets (each turn's prompt holds the earlier
  turns' answers), giving every prompt and the engine's plain tokens/s;
* speculative: the target with each draft (chain of K, vLLM's only draft shape), on exactly those prompts:
  tokens/s and vLLM's counters — drafts, drafted tokens, accepted tokens, accepted per position.

Both are timed in this one process, one after the other (one engine in memory at a time: a GPU holds one), never
read from an earlier run; the load average after each timed call is kept beside the times (``EngineRun.load_1m``).

This module is the engine process's entry point alone: it imports vLLM at its top (nothing else in
specdraft imports it but the plugin).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from specdraft.decoding.speculative import eos_token_ids
from specdraft.evaluation.engine_records import EngineRequest, EngineRun
from specdraft.evaluation.questions import answer_text, render_prompt
from specdraft.evaluation.records import load_1m
from specdraft.configs.evaluation import EngineSettings
from specdraft.target import load_tokenizer

METRIC = "vllm:spec_decode_"


def _llm(request: EngineRequest, settings: EngineSettings, draft: dict[str, str] | None):
    cpu = not torch.cuda.is_available()
    dtype = settings.dtype if settings.dtype != "auto" else ("float32" if cpu else "auto")
    kwargs = {}
    if draft is not None:
        kwargs["speculative_config"] = {**draft, "num_speculative_tokens": settings.speculative_tokens}
    if settings.tensor_parallel_size == 1:
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(model=request.target, tokenizer=request.target, dtype=dtype, max_model_len=settings.max_model_len,
               tensor_parallel_size=settings.tensor_parallel_size, trust_remote_code=False, seed=request.seed,
               disable_log_stats=False,  # the spec_decode counters
               enforce_eager=cpu if settings.enforce_eager is None else settings.enforce_eager,
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


def _generate(llm, prompts: list[list[int]], params) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def _note_load(run: EngineRun, measured: str, dataset: str) -> None:
    load = load_1m()
    if load is not None:
        run.load_1m.setdefault(measured, {}).setdefault(dataset, []).append(load)


def run_engine(request: EngineRequest) -> EngineRun:
    """The engine process: vanilla turn by turn (building the prompts), then each draft on the same prompts."""
    settings = EngineSettings(**request.settings)
    tokenizer = load_tokenizer(request.target)
    eos = eos_token_ids(None, tokenizer)
    params = SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k or -1,
                            max_tokens=request.max_new_tokens, seed=request.seed, skip_special_tokens=True)
    run = EngineRun(engine={"name": "vllm", "version": vllm.__version__, "max_model_len": settings.max_model_len})
    llm = _llm(request, settings, None)
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
            answers, seconds = _generate(llm, prompts, params)
            run.vanilla_s[dataset] += seconds
            _note_load(run, "vanilla", dataset)
            for q, prompt, answer in zip(asked, prompts, answers):
                history[q["index"]].append({"role": "assistant", "content": answer_text(tokenizer, answer, eos)})
                run.prompts.append(prompt)
                run.vanilla.append(answer)
                run.turns.append({"dataset": dataset, "index": q["index"], "question_id": q["question_id"],
                                  "turn": turn})
    for draft, spec in request.drafts.items():
        del llm
        gc.collect()
        llm = _llm(request, settings, spec)
        answers, seconds, counters = [[] for _ in run.prompts], {}, {}
        for name in dict.fromkeys(t["dataset"] for t in run.turns):  # one dataset at a time: its own counters
            rows = [i for i, t in enumerate(run.turns) if t["dataset"] == name]
            before = _counters(llm)
            out, seconds[name] = _generate(llm, [run.prompts[i] for i in rows], params)
            _note_load(run, draft, name)
            after = _counters(llm)
            for i, answer in zip(rows, out):
                answers[i] = answer
            counters[name] = {k: ([a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list)
                                  else v - before.get(k, 0)) for k, v in after.items()}
        run.spec[draft], run.spec_s[draft], run.counters[draft] = answers, seconds, counters
    return run


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = (argv or sys.argv[1:])[:2]
    run = run_engine(EngineRequest(**json.loads(Path(request_path).read_text())))
    Path(result_path).write_text(json.dumps(asdict(run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
