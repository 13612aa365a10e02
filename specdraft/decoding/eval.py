"""Acceptance-length evaluation on MT-Bench-format question sets (DESIGN.md "Evaluation").

A question file is JSON Lines (or a JSON list) of ``{"question_id", "category", "turns"}``;
its dataset name is the file stem (the parent folder's name for a file called
``question.jsonl``, as in FastChat's ``data/mt_bench/question.jsonl``). For every question,
turn by turn: the conversation so far is rendered with the target tokenizer's chat template
(``add_generation_prompt=True``), the target's vanilla decoding and speculative decoding run
on that prompt (in alternating order, so neither always runs on a warm cache), and the
target's own (vanilla) answer is appended as the assistant message before the next turn —
so both decoders always see the same context.

``evaluate_question`` returns plain per-turn records (JSON-able: they cross process
boundaries), ``build_report`` aggregates them per dataset and per turn (``metrics.summarize``).
Sampling seeds depend only on (seed, question index, turn), so any split of the questions
over workers gives the same records as one process (timings aside).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.utils.logging import tqdm

from specdraft.config import to_dict
from specdraft.decoding.metrics import first_mismatch, summarize
from specdraft.decoding.speculative import DecodeConfig, eos_token_ids, speculative_generate, vanilla_generate
from specdraft.models import load_draft
from specdraft.target import load_target_model, load_tokenizer

TIMING_KEYS = ("wall_s", "draft_s", "verify_s", "baseline_wall_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSettings:
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    max_questions: int | None = None  # per question file
    seed: int = 0
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    system_prompt: str | None = None
    warmup: bool = True  # one short untimed generation before the first timed one


@dataclass
class Models:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    eos_ids: frozenset[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    assert name in dtypes, f"dtype must be auto or one of {sorted(dtypes)}, got {name!r}"
    return dtypes[name]


def load_models(target_dir: str | Path, draft_dir: str | Path, settings: EvalSettings) -> Models:
    """Target (full model), draft and tokenizer on the settings' device and dtype."""
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    target = load_target_model(target_dir, dtype=dtype, device=device)
    draft = load_draft(draft_dir, device=device, dtype=dtype)
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
    device = next(models.target.parameters()).device
    vanilla_generate(models.target, ids, cfg, models.eos_ids, _generator(0, device))
    speculative_generate(models.target, models.draft, ids, cfg, models.eos_ids, _generator(0, device))


def evaluate_question(models: Models, question: dict[str, Any], settings: EvalSettings) -> list[dict[str, Any]]:
    """Vanilla and speculative decoding of every turn of one question; one record per turn."""
    cfg = settings.decode
    device = next(models.target.parameters()).device
    messages = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    records = []
    for turn, text in enumerate(question["turns"], start=1):
        messages.append({"role": "user", "content": text})
        prompt = render_prompt(models.tokenizer, messages)
        seed = turn_seed(settings.seed, question["index"], turn)
        spec_first = (question["index"] + turn) % 2 == 1  # alternate the order: neither always runs warm
        for which in ("spec", "base") if spec_first else ("base", "spec"):
            gen = _generator(seed, device)
            if which == "spec":
                spec = speculative_generate(models.target, models.draft, prompt, cfg, models.eos_ids, gen)
            else:
                base = vanilla_generate(models.target, prompt, cfg, models.eos_ids, gen)
        greedy = cfg.sampling.greedy
        records.append({
            "dataset": question["dataset"],
            "index": question["index"],
            "question_id": question["question_id"],
            "category": question["category"],
            "turn": turn,
            "prompt_tokens": len(prompt),
            "new_tokens": len(spec.tokens),
            "rounds": spec.rounds,
            "round_tokens": sum(spec.round_tokens),
            "accepted": spec.accepted,
            "depth_tried": spec.depth_tried,
            "depth_accepted": spec.depth_accepted,
            "stop": spec.stop,
            "tokens_sha": hashlib.sha256(json.dumps(spec.tokens).encode()).hexdigest()[:16],
            "baseline_new_tokens": len(base.tokens),
            "lossless": (spec.tokens == base.tokens) if greedy else None,
            "first_mismatch": first_mismatch(spec.tokens, base.tokens) if greedy else None,
            "wall_s": spec.wall_s,
            "draft_s": spec.draft_s,
            "verify_s": spec.verify_s,
            "baseline_wall_s": base.wall_s,
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


def run_eval(
    target_dir: str | Path,
    draft_dir: str | Path,
    question_files: list[str | Path],
    settings: EvalSettings = EvalSettings(),
    progress: bool = True,
) -> dict[str, Any]:
    """Single-process evaluation: load once, run every question, return the report."""
    questions = load_question_sets(question_files, settings.max_questions)
    models = load_models(target_dir, draft_dir, settings)
    if settings.warmup:
        warmup(models, settings)
    records = []
    for q in tqdm(questions, desc="eval", unit="question", disable=not progress):
        records += evaluate_question(models, q, settings)
    extra = {"target": str(target_dir), "draft": str(draft_dir), "questions": [str(f) for f in question_files]}
    return build_report(records, settings_dict(settings, **extra))


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    return path
