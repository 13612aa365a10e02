"""The target's answers to conversation prompts: stop tokens, per-row seeds, batched generation and the
multi-turn loop (the regenerate stage's generation, ``pipelines/regenerate.py``).

Self-distillation ("Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
§3.3.2): each user turn is answered by the target conditioned on its own earlier answers.
``regenerate_rows`` runs the turns for any backend given an ``AnswerFn``; ``hf_answer_fn`` is the
``transformers`` one (``generate_batch``: left-padded, stop on eos or the template's end-of-turn token),
``vllm_answer_fn`` the vLLM engine's (the same prompt ids in, token ids out, cut and decoded alike).
Sampling draws each row's tokens from its own generator seeded by ``(seed, conversation id, turn)``, so
a row's answer does not depend on which batch it lands in.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from specdraft.chat import assistant_spans
from specdraft.decoding.sampling import keep_top_p
from specdraft.placement import input_device


class GenerationSettings(Protocol):
    """What generation reads of the stage's settings (``RegenerateConfig`` has them)."""

    temperature: float  # 0: greedy
    top_p: float
    max_new_tokens: int  # per assistant turn
    seed: int
    batch_size: int  # prompts per generate call


# --- stop tokens and seeds -------------------------------------------------------------------


def end_of_turn_token(tokenizer) -> int | None:
    """Id of the token the chat template closes an assistant turn with, if it is one token."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        text, spans = assistant_spans(tokenizer, probe)
    except Exception:  # no chat template, or one that needs other roles: eos ids only
        return None
    start, end = spans[0]
    marker = text[start + len("Hello"): end] if text[start:].startswith("Hello") else ""
    ids = tokenizer.convert_tokens_to_ids([marker]) if marker else []
    unk = getattr(tokenizer, "unk_token_id", None)
    return ids[0] if ids and ids[0] is not None and ids[0] != unk else None


def stop_token_ids(tokenizer, generation_config: GenerationConfig | None) -> list[int]:
    """generation_config eos ids, the tokenizer's eos and the template's end-of-turn token."""
    ids: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None)
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]) + [
        tokenizer.eos_token_id, end_of_turn_token(tokenizer)
    ]:
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if not ids:
        raise ValueError("the target has no eos token and its chat template no end-of-turn token")
    return ids


def conversation_seed(seed: int, conv_id: str, turn: int) -> int:
    """A 63-bit seed for one turn of one conversation."""
    digest = hashlib.sha256(f"{seed}\0{conv_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# --- batched generation (hf) ------------------------------------------------------------------


class RowSampler(LogitsProcessor):
    """Temperature / top-p sampling (``keep_top_p``, the decoders' top-p) with one ``torch.Generator`` per row.

    Returns scores that are -inf everywhere but the sampled token, so greedy decoding picks
    it: each row's draw depends only on its own seed and its own logits.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.seeds, self.temperature, self.top_p = seeds, temperature, top_p
        self.generators: list[torch.Generator] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.generators:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        if self.top_p < 1.0:
            probs = probs.masked_fill(~keep_top_p(probs, self.top_p), 0.0)  # (B, V)
        picks = torch.cat([
            torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)
        ])  # (B,)
        out = torch.full_like(scores, float("-inf"))  # (B, V)
        return out.scatter(-1, picks[:, None], 0.0)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu"):
    """``input_ids`` and ``attention_mask`` (B, T) with every prompt right-aligned."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for b, p in enumerate(prompts):
        input_ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, width - len(p):] = 1
    return input_ids.to(device), attention_mask.to(device)


@torch.no_grad()
def generate_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop_ids: list[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seeds: list[int] | None = None,
) -> list[tuple[list[int], bool]]:
    """Per prompt: the new tokens before the first stop token, and whether a stop token ended it."""
    input_ids, attention_mask = left_pad(prompts, pad_id, input_device(model))  # (B, T): the embedding's device
    generation_config = GenerationConfig(  # ours is the whole policy: no sampling defaults leak in
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        temperature=1.0, top_p=1.0, top_k=50, typical_p=1.0, repetition_penalty=1.0,
        eos_token_id=list(stop_ids), pad_token_id=pad_id,
    )
    processors = LogitsProcessorList()
    if temperature > 0:
        if seeds is None or len(seeds) != len(prompts):
            raise ValueError("sampling needs one seed per prompt")
        processors.append(RowSampler(seeds, temperature, top_p))
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask,
        generation_config=generation_config, logits_processor=processors,
    )  # (B, T + n)
    return [split_at_stop(row, stop_ids) for row in out[:, input_ids.shape[1]:].tolist()]


def split_at_stop(tokens: list[int], stop_ids: Iterable[int]) -> tuple[list[int], bool]:
    """The tokens before the first stop token, and whether there was one (what every backend keeps)."""
    stops = set(stop_ids)
    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
    return (list(tokens) if cut is None else list(tokens[:cut])), cut is not None


def decoded_answer(tokenizer, tokens: list[int], stopped: bool) -> Answer:
    """An ``Answer`` of the tokens ``split_at_stop`` kept (the stop token counts as generated)."""
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens) + stopped, stopped


# --- the multi-turn loop (any backend) -----------------------------------------------------


Answer = tuple[str, int, bool]  # (text, tokens generated incl. the stop token, stopped)
AnswerFn = Callable[[list[list[int]], list[list[dict[str, str]]], list[int]], list[Answer]]


def prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and a generation prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate_rows(
    rows: list[dict[str, Any]],
    tokenizer,
    answer: AnswerFn,
    cfg: GenerationSettings,
    max_model_len: int,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Answer every user turn of ``rows`` in order, each conditioned on the earlier answers.

    ``answer(prompt_ids, messages, seeds)`` answers a list of prompts at once. A conversation
    whose next prompt (plus ``max_new_tokens``) exceeds ``max_model_len`` ends before that
    turn; one that cannot answer its first turn is dropped and counted in ``too_long_ids``.
    """
    history = [[m for m in r["messages"] if m["role"] == "system"] for r in rows]
    users = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in rows]
    open_ = [True] * len(rows)
    stats = {"turns": 0, "truncated_turns": 0, "empty_answers": 0, "tokens": 0, "prompt_tokens": 0,
             "cut_turns": 0, "generate_s": 0.0}
    for turn in range(max((len(u) for u in users), default=0)):
        active, prompts, messages = [], [], []
        for i in range(len(rows)):
            if not open_[i] or turn >= len(users[i]):
                continue
            msgs = history[i] + [{"role": "user", "content": users[i][turn]}]
            ids = prompt_ids(tokenizer, msgs)
            if len(ids) + cfg.max_new_tokens > max_model_len:
                open_[i] = False
                stats["cut_turns"] += len(users[i]) - turn
                continue
            active.append(i)
            prompts.append(ids)
            messages.append(msgs)
        if not active:
            continue
        seeds = [conversation_seed(cfg.seed, rows[i]["id"], turn) for i in active]
        started = time.perf_counter()
        answers = answer(prompts, messages, seeds)
        stats["generate_s"] += time.perf_counter() - started
        for i, msgs, ids, (text, n_tokens, stopped) in zip(active, messages, prompts, answers):
            history[i] = msgs + [{"role": "assistant", "content": text}]
            stats["turns"] += 1
            stats["tokens"] += n_tokens
            stats["prompt_tokens"] += len(ids)
            stats["truncated_turns"] += not stopped
            stats["empty_answers"] += not text.strip()
    out, too_long = [], []
    for row, msgs in zip(rows, history):
        if any(m["role"] == "assistant" for m in msgs):
            out.append({"id": row["id"], "source": row["source"], "messages": msgs})
        else:
            too_long.append(row["id"])
    stats["too_long_ids"] = too_long
    return out, stats


def hf_answer_fn(model, tokenizer, cfg: GenerationSettings, stop_ids: list[int]) -> AnswerFn:
    """An ``AnswerFn`` over ``generate_batch`` (prompts sorted by length into ``batch_size`` groups)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]

    def answer(prompts, messages, seeds):
        results: list[Answer | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), cfg.batch_size):
            group = order[start: start + cfg.batch_size]
            generated = generate_batch(
                model, [prompts[i] for i in group], max_new_tokens=cfg.max_new_tokens, stop_ids=stop_ids,
                pad_id=pad_id, temperature=cfg.temperature, top_p=cfg.top_p, seeds=[seeds[i] for i in group],
            )
            for i, (tokens, stopped) in zip(group, generated):
                results[i] = decoded_answer(tokenizer, tokens, stopped)
        return results

    return answer


def vllm_answer_fn(llm, tokenizer, cfg: GenerationSettings, stop_ids: list[int]) -> AnswerFn:
    """An ``AnswerFn`` over a vLLM engine (``vllm.LLM``): a turn's prompts in one ``generate`` (the engine batches
    and schedules them), each with its row's seed; prompt ids in, token ids out (no detokenizing in the engine),
    cut at the first stop token and decoded as ``hf_answer_fn``'s answers are."""
    from vllm import SamplingParams

    def answer(prompts, messages, seeds):
        params = [SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                                 stop_token_ids=stop_ids, seed=seed, detokenize=False) for seed in seeds]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # input order
        return [decoded_answer(tokenizer, *split_at_stop(list(o.outputs[0].token_ids), stop_ids)) for o in outputs]

    return answer
