"""Acceptance-length evaluation on MT-Bench-format question sets (README "Evaluation and the
prompt-lookup floor"; τ as in "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", §5; the question format of "Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena").

A question file is JSON Lines (or a JSON list) of ``{"question_id", "category", "turns"}``;
its dataset name is the file stem (the parent folder's name for a file called
``question.jsonl``, as in FastChat's ``data/mt_bench/question.jsonl``). For every question,
turn by turn: the conversation so far is rendered with the target tokenizer's chat template
(``add_generation_prompt=True``), the target's vanilla decoding and speculative decoding run
on that prompt, and so does prompt-lookup decoding (``prompt_lookup``: the training-free
floor, unless ``pld.enabled`` is off) — in rotating order, so none always runs on a warm
cache — and the target's own (vanilla) answer is appended as the assistant message before
the next turn, so every decoder always sees the same context.

The floor: PLD runs with the turn's decode settings (sampling, max_new_tokens, seed) and
``pld.gamma`` tokens per round, by default the draft's max depth (chain γ or tree depth); its
counts go into the record with the suffix ``_pld`` and the summary reports ``tau_pld``,
``alpha_pld``, ``pld_lossless`` and ``tau_over_pld`` beside the draft's τ (``metrics``).

``evaluate_question`` returns plain per-turn records (JSON-able: they cross process
boundaries), ``build_report`` aggregates them per dataset and per turn (``metrics.summarize``).
Sampling seeds depend only on (seed, question index, turn), so any split of the questions
over workers gives the same records as one process (timings aside): ``run_eval`` spreads the
questions over processes (``replicas``: one per CPU core, or per ``gpus`` GPUs) by default.

Vanilla decoding and the floor depend only on (target, questions, decode settings): they are
decoded once and read back from a cache (``baselines``) when another draft is evaluated on the same
questions; each record says whether its baseline / floor came from there (``baseline_cached``,
``pld_cached``) and the report's ``settings.baselines`` what was reused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.utils.logging import tqdm

from specdraft import files
from specdraft.config import to_dict
from specdraft.decoding.baselines import CACHE_FIELD, Baselines, machine, prompt_digest
from specdraft.decoding.metrics import first_mismatch, summarize
from specdraft.decoding.prompt_lookup import prompt_lookup_generate
from specdraft.decoding.speculative import (
    DecodeConfig,
    Generation,
    eos_token_ids,
    speculative_generate,
    vanilla_generate,
)
from specdraft.models import check_draft_target, load_draft
from specdraft.placement import (
    MASK_ATTN_IMPLEMENTATIONS,
    describe_placement,
    output_device,
    resolve_device,
    resolve_dtype,
)
from specdraft.configs.evaluation import EngineSettings, EvalSettings  # noqa: F401 - imported from here too
from specdraft.target import load_target_model, load_tokenizer, target_fingerprint

TIMING_KEYS = ("wall_s", "draft_s", "verify_s", "baseline_wall_s", "wall_s_pld", "draft_s_pld", "verify_s_pld")


@dataclass
class Models:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    eos_ids: frozenset[int]


def load_models(target_dir: str | Path, draft_dir: str | Path, settings: EvalSettings) -> Models:
    """Target (full model, over ``settings.gpus`` GPUs), draft and tokenizer in the settings' dtype.

    The draft lives on the target's output device (its lm_head's GPU): the hidden states it reads
    and the logits acceptance compares come out there. The draft is checked against the target first
    (``check_draft_target``: ``TargetMismatch`` naming both fingerprints), before any model loads.
    """
    check_draft_target(draft_dir, target_dir)
    assert settings.attn_implementation in MASK_ATTN_IMPLEMENTATIONS, (
        f"eval needs an attention kernel that takes the tree mask {MASK_ATTN_IMPLEMENTATIONS}, "
        f"got {settings.attn_implementation!r}"
    )
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    target = load_target_model(target_dir, dtype=dtype, device=device, gpus=settings.gpus,
                               attn_implementation=settings.attn_implementation)
    out = output_device(target)  # the lm_head's device: the draft reads hidden states there
    heads = (target.get_input_embeddings().weight.to(out), target.get_output_embeddings().weight)  # shared, not copied
    draft = load_draft(draft_dir, device=out, dtype=dtype, heads=heads)
    tokenizer = load_tokenizer(target_dir)
    vocab = target.get_output_embeddings().weight.shape[0]
    assert draft.config.vocab_size == vocab and draft.config.hidden_size == target.config.hidden_size, (
        f"draft (vocab {draft.config.vocab_size}, d {draft.config.hidden_size}) does not match the target "
        f"(vocab {vocab}, d {target.config.hidden_size})"
    )
    return Models(target, draft, tokenizer, eos_token_ids(target, tokenizer))


def dataset_name(path: str | Path) -> str:
    path = Path(path)
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


def read_questions(path: str | Path) -> list[dict[str, Any]]:
    """The questions of one MT-Bench-format file (JSON Lines or a JSON list)."""
    text = Path(path).read_text()
    stripped = text.lstrip()
    rows = json.loads(text) if stripped.startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    for i, row in enumerate(rows):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}: question {i} needs a non-empty list of strings under 'turns'")
    return rows


def load_question_sets(files: list[str | Path], max_questions: int | None = None) -> list[dict[str, Any]]:
    """All questions of ``files`` (the first ``max_questions`` of each), numbered globally."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for path in files:
        name = dataset_name(path)
        assert name not in names, f"two question files map to dataset {name!r}: {names.get(name)} and {path}"
        names[name] = str(path)
        rows = read_questions(path)
        for row in rows[:max_questions] if max_questions is not None else rows:
            out.append({
                "dataset": name,
                "index": len(out),
                "question_id": row.get("question_id", len(out)),
                "category": row.get("category", ""),
                "turns": list(row["turns"]),
            })
    return out


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the generation prompt."""
    assert getattr(tokenizer, "chat_template", None), "the target tokenizer has no chat template"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_text(tokenizer, tokens: list[int], eos_ids: frozenset[int]) -> str:
    if tokens and tokens[-1] in eos_ids:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def turn_seed(seed: int, index: int, turn: int) -> int:
    return (seed * 1_000_003 + index * 1_009 + turn) % (2**63)


def warmup(models: Models, settings: EvalSettings) -> None:
    """Untimed short generations so the first timed turn pays no first-call costs."""
    cfg = DecodeConfig(**{**to_dict(settings.decode), "max_new_tokens": min(8, settings.decode.max_new_tokens)})
    ids = render_prompt(models.tokenizer, [{"role": "user", "content": "Hello."}])
    device = output_device(models.target)  # where logits are sampled
    vanilla_generate(models.target, ids, cfg, models.eos_ids, _generator(0, device))
    speculative_generate(models.target, models.draft, ids, cfg, models.eos_ids, _generator(0, device))
    if settings.pld.enabled:
        prompt_lookup_generate(models.target, ids, cfg, settings.pld, models.eos_ids, _generator(0, device))


def generation_fields(gen: Generation, base: Generation, greedy: bool, suffix: str = "") -> dict[str, Any]:
    """One decoder's per-turn counts (``metrics.summarize`` reads them), names ending in ``suffix``."""
    fields = {
        "new_tokens": len(gen.tokens),
        "rounds": gen.rounds,
        "round_tokens": sum(gen.round_tokens),
        "accepted": gen.accepted,
        "depth_tried": gen.depth_tried,
        "depth_accepted": gen.depth_accepted,
        "stop": gen.stop,
        "tokens_sha": hashlib.sha256(json.dumps(gen.tokens).encode()).hexdigest()[:16],
        "lossless": (gen.tokens == base.tokens) if greedy else None,
        "first_mismatch": first_mismatch(gen.tokens, base.tokens) if greedy else None,
        "wall_s": gen.wall_s,
        "draft_s": gen.draft_s,
        "verify_s": gen.verify_s,
    }
    return {f"{key}{suffix}": value for key, value in fields.items()}


def evaluate_question(
    models: Models, question: dict[str, Any], settings: EvalSettings, cached: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Vanilla, speculative and (the floor) prompt-lookup decoding of every turn of one question;
    one record per turn. ``cached`` (``Baselines.for_question``): vanilla / floor entries per turn,
    used when the turn's prompt is the one they were decoded from; what is decoded here instead
    travels to the cache in each record's ``CACHE_FIELD`` (popped by ``Baselines.absorb``)."""
    cfg = settings.decode
    device = output_device(models.target)  # generators live where logits are sampled (the lm_head's device)
    messages = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    cached = cached or {"vanilla": {}, "pld": {}}
    records = []
    for turn, text in enumerate(question["turns"], start=1):
        messages.append({"role": "user", "content": text})
        prompt = render_prompt(models.tokenizer, messages)
        seed = turn_seed(settings.seed, question["index"], turn)
        found = {kind: cached[kind].get(str(turn)) for kind in ("vanilla", "pld")}
        usable = {kind: e for kind, e in found.items() if e is not None and e.get("prompt") == prompt_digest(prompt)}
        decoders = ["spec"] + ([] if "vanilla" in usable else ["base"])
        decoders += ["pld"] if settings.pld.enabled and "pld" not in usable else []
        shift = (question["index"] + turn) % len(decoders)  # rotate the order: none always runs warm
        gens: dict[str, Generation] = {}
        for which in decoders[shift:] + decoders[:shift]:
            gen = _generator(seed, device)
            if which == "spec":
                gens[which] = speculative_generate(models.target, models.draft, prompt, cfg, models.eos_ids, gen)
            elif which == "pld":
                gens[which] = prompt_lookup_generate(models.target, prompt, cfg, settings.pld, models.eos_ids, gen)
            else:
                gens[which] = vanilla_generate(models.target, prompt, cfg, models.eos_ids, gen)
        carry: dict[str, Any] = {}
        if "vanilla" in usable:
            entry = usable["vanilla"]
            base = Generation(list(entry["tokens"]), rounds=entry["rounds"], wall_s=entry["wall_s"], stop=entry["stop"])
        else:
            base = gens["base"]
            carry["vanilla"] = {"prompt": prompt_digest(prompt), "tokens": base.tokens, "rounds": base.rounds,
                                "wall_s": base.wall_s, "stop": base.stop}
        greedy = cfg.sampling.greedy
        floor: dict[str, Any] = {}
        if settings.pld.enabled:
            if "pld" in usable:
                floor = dict(usable["pld"]["fields"])
            else:
                floor = generation_fields(gens["pld"], base, greedy, "_pld")
                carry["pld"] = {"prompt": prompt_digest(prompt), "fields": floor}
        records.append({
            "dataset": question["dataset"],
            "index": question["index"],
            "question_id": question["question_id"],
            "category": question["category"],
            "turn": turn,
            "prompt_tokens": len(prompt),
            **generation_fields(gens["spec"], base, greedy),
            "baseline_new_tokens": len(base.tokens),
            "baseline_wall_s": base.wall_s,
            "baseline_cached": "vanilla" in usable,
            "baseline_stale": found["vanilla"] is not None and "vanilla" not in usable,
            **floor,
            **({"pld_cached": "pld" in usable, "pld_stale": found["pld"] is not None and "pld" not in usable}
               if settings.pld.enabled else {}),
            CACHE_FIELD: carry,
        })
        messages.append({"role": "assistant", "content": answer_text(models.tokenizer, base.tokens, models.eos_ids)})
    return records


def settings_dict(settings: EvalSettings, **extra: Any) -> dict[str, Any]:
    return {**to_dict(settings), **extra, "torch": torch.__version__}


def build_report(records: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """Per-dataset metrics with a per-turn breakdown, overall metrics, and the records."""
    records = sorted(records, key=lambda r: (r["index"], r["turn"]))
    datasets: dict[str, Any] = {}
    for name in dict.fromkeys(r["dataset"] for r in records):
        rows = [r for r in records if r["dataset"] == name]
        turns = sorted({r["turn"] for r in rows})
        datasets[name] = {
            **summarize(rows),
            "turns": {str(t): summarize(r for r in rows if r["turn"] == t) for t in turns},
        }
    return {"settings": settings, "datasets": datasets, "overall": summarize(records), "records": records}


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
    """The vanilla / floor cache of these questions under these settings (``baselines.Baselines``)."""
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


def run_eval(
    target_dir: str | Path,
    draft_dir: str | Path,
    question_files: list[str | Path],
    settings: EvalSettings = EvalSettings(),
    progress: bool = True,
    report_path: str | Path | None = None,
    baselines_home: str | Path | None = None,
) -> dict[str, Any]:
    """Evaluate every question — in this process, or spread over worker processes (``replicas``) —
    reusing cached baselines (``baselines_dir``); return the report."""
    from specdraft.decoding.replicas import evaluate_in_processes, plan_workers

    questions = load_question_sets(question_files, settings.max_questions)
    check_draft_target(draft_dir, target_dir)
    plan = plan_workers(settings, len(questions))
    cache = open_baselines(baselines_dir(settings, report_path, baselines_home), target_dir, questions, settings, plan.device,
                           plan.workers, plan.threads)
    cached = [cache.for_question(q) for q in questions]
    if plan.workers == 1:
        models = load_models(target_dir, draft_dir, settings)
        if settings.warmup:
            warmup(models, settings)
        records = []
        for q, c in tqdm(list(zip(questions, cached)), desc="eval", unit="question", disable=not progress):
            records += evaluate_question(models, q, settings, c)
        placements = [describe_placement(models.target)]
    else:
        records, placements = evaluate_in_processes(target_dir, draft_dir, questions, cached, settings, plan, progress)
    cache.absorb(records)
    extra = {"target": str(target_dir), "draft": str(draft_dir), "questions": [str(f) for f in question_files],
             "placement": placements,  # kernel, dtype, devices actually used
             "workers": plan.describe(), "baselines": cache.summary()}
    return build_report(records, settings_dict(settings, **extra))


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report as JSON, whole (temporary name, then rename)."""
    return files.write_text(path, json.dumps(report, indent=2) + "\n")
