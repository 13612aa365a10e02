"""Engine-measured evaluation: the target served by vLLM with an exported draft, beside our own decoder.

The engine is the judge of a draft ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees" §5 defines the acceptance length our decoder reports; vLLM reports its own). ``measure_engine``
runs the engine in a child process (``python -m specdraft.serving.engine REQUEST RESULT``: vLLM's
global state — its engine processes, thread binding, Prometheus counters — stays out of the caller):

* vanilla: the target alone, turn by turn over the question sets (each turn's prompt holds the
  earlier turns' answers), giving every prompt and the engine's plain tokens/s;
* speculative: the target with the draft (chain of K, vLLM's only draft shape), on exactly those
  prompts: tokens/s and vLLM's counters — drafts, drafted tokens, accepted tokens, accepted per
  position. Mean acceptance length = 1 + accepted / drafts (SGLang's τ: tokens per verification).

Counting: vLLM compares all K drafts of a round with the target before it applies the stop token, so
a drafted token after EOS that matches still counts as accepted. ``compare`` counts our decoder the
same way: it decodes each prompt with the EOS stop off and ``max_new_tokens`` = the engine's answer
length (EOS included), which leaves every round as it was and the last one uncut.

Settings (``EngineSettings``, ``eval.engine`` in a run config) pass straight to ``vllm.LLM``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.config import ConfigError
from specdraft.configs.evaluation import EngineSettings  # noqa: F401 - imported from here too

METRIC = "vllm:spec_decode_"


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineRequest:
    """What the engine process runs (JSON between the processes)."""

    target: str
    drafts: dict[str, dict[str, str]]  # name -> {"model": the exported directory, "method": vLLM's ("eagle", ...)}
    questions: list[dict[str, Any]]  # ``eval.load_question_sets`` rows
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
    engine: dict[str, Any] = field(default_factory=dict)  # name, version, device


def measure_engine(request: EngineRequest, settings: EngineSettings) -> EngineRun:
    """Run ``request`` in a vLLM child process and return its answers and counters."""
    with tempfile.TemporaryDirectory(prefix="specdraft-engine-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(asdict(request)))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.cpu_kvcache_gib),
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        if settings.tensor_parallel_size == 1:  # one process: no engine-core and worker processes to start
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            proc = subprocess.run([sys.executable, "-m", "specdraft.serving.engine", str(req), str(res)], env=env,
                                  capture_output=True, text=True, timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the vLLM engine did not finish within {settings.timeout_s:.0f} s") from None
        if proc.returncode != 0 or not res.is_file():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-25:])
            raise RuntimeError(f"the vLLM engine failed (exit {proc.returncode}):\n{tail}")
        return EngineRun(**json.loads(res.read_text()))


# -- our decoder on the engine's prompts ----------------------------------------------------------------


def compare(run: EngineRun, name: str, models, decode, engine: EngineSettings) -> dict[str, Any]:
    """Our decoder (chain of K, the eval's sampling settings) on the engine's prompts, counted as vLLM counts,
    beside the engine's counters for the draft ``name``: acceptance length, accepted per position, tokens/s,
    per dataset and overall.

    ``models``: ``eval.Models`` of the same target and draft; ``decode``: the eval's ``DecodeConfig``."""
    from dataclasses import replace

    import torch

    from specdraft.decoding.speculative import speculative_generate
    from specdraft.placement import output_device

    k = engine.speculative_tokens
    greedy = decode.temperature == 0
    device = output_device(models.target)
    spec = run.spec[name]
    ours: dict[str, dict[str, Any]] = {}
    for i, (prompt, turn) in enumerate(zip(run.prompts, run.turns)):
        if greedy:  # vLLM's count: every round as it was, the last one uncut by the stop token
            cfg = replace(decode, mode="chain", gamma=k, max_new_tokens=max(1, len(spec[i])))
            eos = frozenset()
        else:
            cfg, eos = replace(decode, mode="chain", gamma=k), models.eos_ids
        gen = speculative_generate(models.target, models.draft, prompt, cfg, eos,
                                   torch.Generator(device=device).manual_seed(i))
        row = ours.setdefault(turn["dataset"], {"rounds": 0, "accepted": 0, "per_pos": [0] * k, "tokens": 0,
                                               "wall_s": 0.0, "prompts": 0, "same_answer": 0})
        row["rounds"] += gen.rounds
        row["accepted"] += sum(gen.accepted)
        row["per_pos"] = [a + b for a, b in zip(row["per_pos"], gen.depth_accepted)]
        row["tokens"] += len(gen.tokens)
        row["wall_s"] += gen.wall_s
        row["prompts"] += 1
        row["same_answer"] += int(gen.tokens == spec[i])
    datasets = {dataset: _dataset_report(run, name, [dataset], row, k, greedy) for dataset, row in ours.items()}
    overall = _dataset_report(run, name, list(ours), _total(ours.values(), k), k, greedy)
    warnings = [f"{dataset}: the engine's acceptance length {d['acceptance_length']:.3f} differs from ours "
                f"{d['tau_ours']:.3f} by {100 * d['gap']:+.1f}% (more than {100 * engine.max_gap:.0f}%)"
                for dataset, d in {**datasets, "overall": overall}.items()
                if d["gap"] is not None and abs(d["gap"]) > engine.max_gap]
    return {"engine": run.engine, "speculative_tokens": k, "greedy": greedy, "datasets": datasets, "overall": overall,
            "warnings": warnings}


def _total(rows, k: int) -> dict[str, Any]:
    rows = list(rows)
    out = {key: sum(r[key] for r in rows) for key in ("rounds", "accepted", "tokens", "wall_s", "prompts", "same_answer")}
    out["per_pos"] = [sum(r["per_pos"][j] for r in rows) for j in range(k)]
    return out


def _dataset_report(run: EngineRun, draft: str, names: list[str], ours: dict[str, Any], k: int,
                    greedy: bool) -> dict[str, Any]:
    counted = run.counters[draft]
    counters = {key: sum(counted[n].get(key, 0) for n in names)
                for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    per_pos = [sum((counted[n].get("num_accepted_tokens_per_pos") or [0] * k)[j] for n in names) for j in range(k)]
    rows = [i for i, t in enumerate(run.turns) if t["dataset"] in names]
    spec = run.spec[draft]
    spec_tokens = sum(len(spec[i]) for i in rows)
    vanilla_tokens = sum(len(run.vanilla[i]) for i in rows)
    spec_s = sum(run.spec_s[draft][n] for n in names)
    vanilla_s = sum(run.vanilla_s[n] for n in names)
    drafts = counters["num_drafts"]
    length = 1 + counters["num_accepted_tokens"] / drafts if drafts else None
    tau_ours = 1 + ours["accepted"] / ours["rounds"] if ours["rounds"] else None
    spec_tps = spec_tokens / spec_s if spec_s else None
    vanilla_tps = vanilla_tokens / vanilla_s if vanilla_s else None
    return {
        "acceptance_length": length,  # vLLM: 1 + accepted / drafts
        "tau_ours": tau_ours,  # ours, counted the same way (chain of K on the same prompts)
        "gap": (length - tau_ours) / tau_ours if length is not None and tau_ours else None,
        "accepted_per_pos": [a / drafts for a in per_pos] if drafts else [],  # P(position j accepted) per round
        "accepted_per_pos_ours": [a / ours["rounds"] for a in ours["per_pos"]] if ours["rounds"] else [],
        "drafts": drafts,
        "rounds_ours": ours["rounds"],
        "prompts": len(rows),
        "same_answer_as_ours": ours["same_answer"] if greedy else None,  # greedy: the engine's tokens equal ours
        "engine_lossless": sum(spec[i] == run.vanilla[i] for i in rows) if greedy else None,
        "tokens_per_s": spec_tps,  # the engine with the draft
        "tokens_per_s_vanilla": vanilla_tps,  # the engine without it
        "speedup": spec_tps / vanilla_tps if spec_tps and vanilla_tps else None,  # the engine's own speedup
        "tokens_per_s_ours": ours["tokens"] / ours["wall_s"] if ours["wall_s"] else None,
    }


def engine_report(target: str | Path, draft: str | Path, question_files: list[str | Path], settings,
                  models=None) -> dict[str, Any]:
    """Export ``draft`` for vLLM, serve it with ``target`` on the questions (``settings``: ``EvalSettings``, whose
    ``engine`` section says how) and compare with our decoder (``models``: already loaded, or loaded here)."""
    from specdraft.decoding.eval import load_models, load_question_sets
    from specdraft.export import VLLM_FORMATS, export_draft, export_layout, formats_for
    from specdraft.models import read_draft_config

    engine = settings.engine
    config = read_draft_config(draft)
    fmt = next((f for f in formats_for(config) if f in VLLM_FORMATS), None)
    if fmt is None:
        raise ConfigError(f"{draft}: no vLLM format serves this draft ({formats_for(config)})")
    questions = load_question_sets(question_files, settings.max_questions)
    with tempfile.TemporaryDirectory(prefix="specdraft-engine-export-") as tmp:
        out = export_draft(draft, fmt, Path(tmp) / fmt, target=target, speculative_tokens=engine.speculative_tokens)
        decode = settings.decode
        request = EngineRequest(target=str(Path(target).resolve()),
                                drafts={"draft": {"model": str(out), "method": export_layout(fmt, out).method}},
                                questions=questions, settings=asdict(engine), temperature=decode.temperature,
                                top_p=decode.top_p, top_k=decode.top_k, max_new_tokens=decode.max_new_tokens,
                                seed=settings.seed, system_prompt=settings.system_prompt)
        run = measure_engine(request, engine)
    models = models if models is not None else load_models(target, draft, settings)
    return {"format": fmt, **compare(run, "draft", models, settings.decode, engine)}


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
                     f"without the draft (engine speedup {fmt(d['speedup'], '.2f')})")
    lines += [f"  warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


# -- the engine process --------------------------------------------------------------------------------


def _llm(request: EngineRequest, settings: EngineSettings, draft: dict[str, str] | None):
    import torch
    from vllm import LLM

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
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], time.perf_counter() - start


def run_engine(request: EngineRequest) -> EngineRun:
    """The engine process: vanilla turn by turn (building the prompts), then each draft on the same prompts."""
    import gc

    import vllm
    from vllm import SamplingParams

    from specdraft.decoding.eval import answer_text, render_prompt
    from specdraft.decoding.speculative import eos_token_ids
    from specdraft.target import load_tokenizer

    settings = EngineSettings(**request.settings)
    tokenizer = load_tokenizer(request.target)
    eos = eos_token_ids(None, tokenizer)
    params = SamplingParams(temperature=request.temperature, top_p=request.top_p, top_k=request.top_k or -1,
                            max_tokens=request.max_new_tokens, seed=request.seed, skip_special_tokens=True)
    run = EngineRun(engine={"name": "vllm", "version": vllm.__version__})
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
