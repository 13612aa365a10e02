"""One question evaluated turn by turn: vanilla, speculative and prompt-lookup decoding on the same prompt,
one plain record per turn (docs/evaluation.md; τ and α as in "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", §5).

For every turn the conversation so far is rendered with the target tokenizer's chat template
(``add_generation_prompt=True``); the target's vanilla decoding, speculative decoding and prompt-lookup
decoding (the training-free floor, unless ``pld.enabled`` is off) run on it, one right after the other —
in rotating order (the record's ``order``), so none always runs on a warm cache — and the target's own
(vanilla) answer is appended as the assistant message before the next turn, so every decoder always sees
the same context. All three are timed here, turn by turn, so a load that comes and goes slows all alike;
the record's ``load_1m`` is the machine's 1-minute load average when the turn ended (``os.getloadavg``).

The floor runs with the turn's decode settings (sampling, max_new_tokens, seed) and ``pld.gamma`` tokens
per round; its counts go into the record with the suffix ``_pld``. Records are JSON-able (they cross
process boundaries) and depend only on (settings, question): sampling seeds come from (seed, question
index, turn). The cache (``baselines``) holds vanilla's tokens and the floor's counts, never a time: a
cached entry whose prompt renders to the same ids is compared with what was decoded now
(``baseline_changed`` / ``pld_changed``); what is new travels to the cache in ``CACHE_FIELD``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from specdraft.configs.evaluation import EvalSettings
from specdraft.decoding.metrics import first_mismatch
from specdraft.decoding.prompt_lookup import prompt_lookup_generate
from specdraft.decoding.speculative import Generation, speculative_generate, vanilla_generate
from specdraft.evaluation.baselines import CACHE_FIELD, token_digest
from specdraft.evaluation.models import Models, generator
from specdraft.evaluation.questions import answer_text, render_prompt
from specdraft.placement import output_device


def turn_seed(seed: int, index: int, turn: int) -> int:
    return (seed * 1_000_003 + index * 1_009 + turn) % (2**63)


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


DECODERS = ("draft", "vanilla", "pld")  # the names a record's ``order`` uses
TIMES = ("wall_s", "draft_s", "verify_s")  # a decoder's timings: never cached


def load_1m() -> float | None:
    """The machine's 1-minute load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _decode_turn(models: Models, prompt: list[int], settings: EvalSettings, seed: int,
                 shift_by: int) -> tuple[dict[str, Generation], list[str]]:
    """Every decoder of the turn — the draft, vanilla and (unless off) the floor — timed one after the other in
    rotating order, each with its own generator seeded by ``seed``; and the order they ran in."""
    cfg = settings.decode
    device = output_device(models.target)  # generators live where logits are sampled (the lm_head's device)
    decoders = list(DECODERS if settings.pld.enabled else DECODERS[:2])
    shift = shift_by % len(decoders)  # rotate the order: none always runs warm
    order = decoders[shift:] + decoders[:shift]
    gens: dict[str, Generation] = {}
    for which in order:
        gen = generator(seed, device)
        if which == "draft":
            gens[which] = speculative_generate(models.target, models.draft, prompt, cfg, models.eos_ids, gen)
        elif which == "pld":
            gens[which] = prompt_lookup_generate(models.target, prompt, cfg, settings.pld, models.eos_ids, gen)
        else:
            gens[which] = vanilla_generate(models.target, prompt, cfg, models.eos_ids, gen)
    return gens, order


def _against_cache(gens: dict[str, Generation], usable: dict[str, Any], prompt: list[int],
                   settings: EvalSettings) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The turn's floor fields, whether vanilla's tokens / the floor's counts differ from the cached ones
    (None: nothing cached for this prompt), and what goes to the cache (no times)."""
    base = gens["vanilla"]
    vanilla = {"prompt": token_digest(prompt), "tokens": base.tokens, "rounds": base.rounds, "stop": base.stop}
    changed: dict[str, Any] = {"baseline_changed": None}
    carry: dict[str, Any] = {}
    if "vanilla" in usable:
        changed["baseline_changed"] = {k: usable["vanilla"].get(k) for k in vanilla} != vanilla
    if changed["baseline_changed"] is not False:
        carry["vanilla"] = vanilla
    floor: dict[str, Any] = {}
    if settings.pld.enabled:
        floor = generation_fields(gens["pld"], base, settings.decode.sampling.greedy, "_pld")
        counts = {k: v for k, v in floor.items() if k[: -len("_pld")] not in TIMES}
        if "pld" in usable:  # what the cache holds beside these counts (an old file's times) is never read
            cached = usable["pld"].get("fields") or {}
            changed["pld_changed"] = {k: cached.get(k) for k in counts} != counts
        else:
            changed["pld_changed"] = None
        if changed["pld_changed"] is not False:
            carry["pld"] = {"prompt": token_digest(prompt), "fields": counts}
    return floor, changed, carry


def evaluate_question(
    models: Models, question: dict[str, Any], settings: EvalSettings, cached: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Vanilla, speculative and (the floor) prompt-lookup decoding of every turn of one question, all timed
    now; one record per turn. ``cached`` (``Baselines.for_question``): vanilla tokens / floor counts per turn,
    compared with this turn's when its prompt is the one they were decoded from; what the cache lacks (or
    holds otherwise) travels to it in each record's ``CACHE_FIELD`` (popped by ``Baselines.absorb``)."""
    messages = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    cached = cached or {"vanilla": {}, "pld": {}}
    records = []
    for turn, text in enumerate(question["turns"], start=1):
        messages.append({"role": "user", "content": text})
        prompt = render_prompt(models.tokenizer, messages)
        seed = turn_seed(settings.seed, question["index"], turn)
        found = {kind: cached[kind].get(str(turn)) for kind in ("vanilla", "pld")}
        usable = {kind: e for kind, e in found.items() if e is not None and e.get("prompt") == token_digest(prompt)}
        gens, order = _decode_turn(models, prompt, settings, seed, question["index"] + turn)
        base = gens["vanilla"]
        floor, changed, carry = _against_cache(gens, usable, prompt, settings)
        records.append({
            "dataset": question["dataset"],
            "index": question["index"],
            "question_id": question["question_id"],
            "category": question["category"],
            "turn": turn,
            "prompt_tokens": len(prompt),
            "order": order,  # the decoders as they ran, one right after the other
            "load_1m": load_1m(),
            **generation_fields(gens["draft"], base, settings.decode.sampling.greedy),
            "baseline_new_tokens": len(base.tokens),
            "baseline_wall_s": base.wall_s,
            "baseline_stale": found["vanilla"] is not None and "vanilla" not in usable,
            **floor,
            **changed,
            **({"pld_stale": found["pld"] is not None and "pld" not in usable} if settings.pld.enabled else {}),
            CACHE_FIELD: carry,
        })
        messages.append({"role": "assistant", "content": answer_text(models.tokenizer, base.tokens, models.eos_ids)})
    return records


def decoded_tokens(records: list[dict[str, Any]]) -> int:
    """The tokens decoded for these records here (the eval's progress lines count them per second): the draft's
    answers, vanilla's and the floor's (every run decodes all three: the cache keeps no times)."""
    return sum(r["new_tokens"] + r["baseline_new_tokens"] + (r.get("new_tokens_pld") or 0) for r in records)
