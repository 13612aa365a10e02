"""Render a conversation with the target's chat template and mark what the draft learns.

The loss mask is 1 on exactly the assistant-content tokens and their end-of-turn token
(docs/concepts.md "The core in one page": feature store). Spans come from the template itself — never
from per-model string hacks — so any HF chat template works:

* prefix-stable templates (most): the text added by rendering assistant message m, versus
  the prefix up to m with a generation prompt, is message m's turn; its content is located
  inside that turn (verbatim, or stripped for templates that ``| trim``) and the span runs
  to the end of the first special token after it (the end-of-turn marker);
* templates that rewrite history (Qwen3 drops/adds think blocks depending on the turn's
  position): each message is found in order in the full rendering, an assistant message
  after its generation-prompt header.

The full text is tokenized once and tokens are marked by their character offsets, so BPE
merges across span boundaries cannot shift the mask.

A target whose tokenizer has no chat template (a base model) gets ``FALLBACK_CHAT_TEMPLATE``
(``ensure_chat_template``, applied by ``specdraft.targets.loading.load_tokenizer`` for every stage), a
plain-text format with the eos token closing each assistant turn::

    {bos}### User:\n{content}\n\n### Assistant:\n{content}{eos}\n\n### User:\n...

(``### System:`` likewise; the generation prompt is ``### Assistant:\n``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from specdraft.vocab import count_predicted_tokens

KNOWN_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>", "<|endoftext|>")

# Plain-text template for targets without one: messages separated by a blank line, each under a
# "### Role:" header, an assistant turn closed by eos (what the model learns to stop with).
FALLBACK_CHAT_TEMPLATE = (
    "{{- bos_token if bos_token else '' }}"
    "{%- for message in messages %}"
    "{%- if not loop.first %}{{- '\n\n' }}{%- endif %}"
    "{{- '### ' + message['role'] | capitalize + ':\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' and eos_token %}{{- eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '\n\n' if messages else '' }}{{- '### Assistant:\n' }}{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    text: str


@dataclass(frozen=True, slots=True)
class TrainingTokens:
    """One conversation as a draft trains on it (``rejected`` None), or why it is left out."""

    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    rejected: str | None = None  # one of REJECT_REASONS


REJECT_REASONS = ("unrenderable", "too_long", "no_loss_tokens")


class RenderError(ValueError):
    """A conversation the chat template cannot render consistently."""


class _PrefixUnstable(RenderError):
    pass


def ensure_chat_template(tokenizer):
    """``tokenizer`` with ``FALLBACK_CHAT_TEMPLATE`` set when it has no chat template (warns once per target)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    warnings.warn(  # the default filter shows a message once: once per target and process
        f"the tokenizer of {getattr(tokenizer, 'name_or_path', '') or 'the target'} has no chat template: using "
        "specdraft's plain-text fallback ('### User:' / '### Assistant:' headers, eos closes an assistant turn)",
        UserWarning, stacklevel=2,
    )
    return tokenizer


def _render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):
        raise RenderError("chat template did not return text")
    return text


def _end_markers(tokenizer) -> list[str]:
    """Texts that can close a turn: the special tokens, eos and common chat end markers in the vocab."""
    vocab = tokenizer.get_vocab()
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    names.update(n for n in KNOWN_END_MARKERS if n in vocab)
    if tokenizer.eos_token:
        names.add(tokenizer.eos_token)
    return sorted(n for n in names if n)


def _find_content(text: str, content: str, start: int, end: int) -> tuple[int, int]:
    """``[a, b)`` of ``content`` (verbatim, else stripped) in ``text[start:end]``; empty -> ``(start, start)``."""
    for candidate in (content, content.strip()):
        if not candidate:
            return start, start
        at = text.find(candidate, start, end)
        if at >= 0:
            return at, at + len(candidate)
    raise RenderError(f"content {content[:60]!r} not found where the template renders it")


def _marker_end(text: str, markers: list[str], start: int, end: int) -> int | None:
    """End of the earliest marker occurring in ``text[start:end]``."""
    hits = [(k, -len(m)) for m in markers if (k := text.find(m, start, end)) >= 0]
    if not hits:
        return None
    k, neg_len = min(hits)
    return k - neg_len


def _prefix_spans(tokenizer, messages, full: str, markers: list[str]) -> list[tuple[int, int]]:
    spans = []
    for m, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:m], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: m + 1], add_generation_prompt=False)
        if not full.startswith(upto) or not upto.startswith(prompt):
            raise _PrefixUnstable(
                f"chat template is not prefix-stable at message {m}: rendering a prefix of the "
                "conversation is not a prefix of rendering the whole"
            )
        start, end = len(prompt), len(upto)
        content_at, content_end = _find_content(upto, message["content"], start, end)
        marker_end = _marker_end(upto, markers, content_end, end)
        spans.append((content_at, end if marker_end is None else marker_end))
    return spans


def _search_spans(tokenizer, messages, full: str, markers: list[str]) -> list[tuple[int, int]]:
    """Locate every message in order in ``full``; assistant content after its header."""
    located: list[tuple[int, int]] = []
    cursor = 0
    for m, message in enumerate(messages):
        if message["role"] == "assistant":
            bare = _render(tokenizer, messages[:m], add_generation_prompt=False) if m else ""
            prompt = _render(tokenizer, messages[:m], add_generation_prompt=True) if m else ""
            header = prompt[len(bare):] if prompt.startswith(bare) else ""
            # generation prompts may carry extras the history does not (an empty think block):
            # the longest prefix of the header that occurs is the turn's header
            while header and full.find(header, cursor) < 0:
                header = header[:-1]
            if header:
                cursor = full.find(header, cursor) + len(header)
        try:
            a, b = _find_content(full, message["content"], cursor, len(full))
        except RenderError:
            raise RenderError(
                f"chat template is not prefix-stable and message {m} ({message['role']}) is not "
                "rendered verbatim in the conversation"
            ) from None
        located.append((a, b))
        cursor = b
    spans = []
    for m, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        a, b = located[m]
        bound = located[m + 1][0] if m + 1 < len(messages) else len(full)
        marker_end = _marker_end(full, markers, b, bound)
        if marker_end is None:
            raise RenderError(f"no end-of-turn marker after assistant message {m}")
        spans.append((a, marker_end))
    return spans


def assistant_spans(tokenizer, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the character spans [start, end) of each assistant turn.

    A span runs from the start of the assistant's content (as the template renders it) to the
    end of its end-of-turn marker; template text before the content (headers, empty think
    blocks) and after the marker (newlines) is excluded.
    """
    full = _render(tokenizer, messages, add_generation_prompt=False)
    markers = _end_markers(tokenizer)
    try:
        return full, _prefix_spans(tokenizer, messages, full, markers)
    except _PrefixUnstable:
        return full, _search_spans(tokenizer, messages, full, markers)


def render_with_loss_mask(tokenizer, messages: list[dict[str, str]], max_length: int | None = None) -> Rendered:
    """Token ids of the rendered conversation and a 0/1 mask over assistant tokens."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    for i, (a, b) in enumerate(offsets):
        if b <= a:
            continue
        # inside a span, or straddling its boundary (template text glued onto content by a merge)
        if any(a < e and b > s for s, e in spans):
            mask[i] = 1
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return Rendered(input_ids=list(ids), loss_mask=mask, text=text)


def unique_conversations(rows: list[dict]) -> tuple[list[tuple[str, list[dict[str, str]]]], int]:
    """Rows ``{id, messages}`` -> ``(id, messages)`` sorted by id, the first row of an id winning, and
    the number of duplicate rows dropped: the order of a store's sequences (dump) and online features."""
    unique: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        unique.setdefault(str(row["id"]), row["messages"])
    return sorted(unique.items()), len(rows) - len(unique)


def tokenize_conversation(
    tokenizer, messages: list[dict[str, str]], max_length: int, overlong: Literal["truncate", "reject"] = "truncate"
) -> TrainingTokens:
    """The tokens and loss mask the dump stores for one conversation, or the reason it stores nothing.

    The one tokenization of training data (``tokenize_conversations``: the dump's shards, online features):
    a conversation the template cannot render is ``unrenderable``; one longer than ``max_length``
    is truncated (``overlong="truncate"``) or ``too_long``; one without an assistant token before its last
    token (after truncation: a position whose next token is trained) is ``no_loss_tokens``.
    """
    assert overlong in ("truncate", "reject"), f"overlong must be truncate or reject, got {overlong!r}"
    try:
        r = render_with_loss_mask(tokenizer, messages)
    except Exception:  # noqa: BLE001 - any template/format failure: the caller counts the row
        return TrainingTokens([], [], rejected="unrenderable")
    ids, mask, truncated = r.input_ids, r.loss_mask, False
    if len(ids) > max_length:
        if overlong == "reject":
            return TrainingTokens([], [], rejected="too_long")
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    if not any(mask[:-1]):  # the last position predicts nothing: its next token is not in the sequence
        return TrainingTokens([], [], truncated=truncated, rejected="no_loss_tokens")
    return TrainingTokens(ids, mask, truncated=truncated)


REJECTED_EXAMPLES = 5  # sample ids kept per reject reason, for the dump's shard records


@dataclass(frozen=True, slots=True)
class TokenizedConversations:
    """Conversations as the dump stores their tokens: kept rows in store order, and what was left out."""

    sample_ids: list[str]
    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    truncated: int = 0
    duplicates: int = 0
    # the first REJECTED_EXAMPLES sample ids of each reject reason that occurred
    rejected_examples: dict[str, list[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sample_ids)

    def concatenated(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All sequences in a row, as a store shard holds them: ``input_ids`` int32 (N,), ``loss_mask``
        uint8 (N,) and ``offsets`` int64 (S+1,) (sequence i is ``[offsets[i], offsets[i+1])``)."""
        lengths = [len(ids) for ids in self.input_ids]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)  # (S+1,)
        ids = np.asarray([t for seq in self.input_ids for t in seq], np.int32)  # (N,)
        mask = np.asarray([m for seq in self.loss_mask for m in seq], np.uint8)  # (N,)
        return ids, mask, offsets

    def predicted_token_counts(self, vocab_size: int) -> np.ndarray:
        """Counts (vocab_size,) of the tokens following loss-masked positions: what
        ``store.predicted_token_counts`` counts in a store of these sequences."""
        ids, mask, offsets = self.concatenated()
        return count_predicted_tokens(ids, mask, offsets, vocab_size)


def tokenize_conversations(
    tokenizer, rows: list[dict[str, Any]], max_length: int, overlong: Literal["truncate", "reject"] = "truncate"
) -> TokenizedConversations:
    """Rows ``{id, messages}`` -> the sequences a store of them holds, in its order.

    ``unique_conversations`` orders them as a dump's shard plan (``store.plan_shards``) orders a store's
    sequences; every row goes through ``tokenize_conversation``. The dump tokenizes each shard's rows
    with it, online features all rows at once: the same sequences either way."""
    ordered, duplicates = unique_conversations(rows)
    sample_ids, input_ids, loss_mask = [], [], []
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    examples: dict[str, list[str]] = {}
    truncated = 0
    for sample_id, messages in ordered:
        tokens = tokenize_conversation(tokenizer, messages, max_length, overlong)
        truncated += tokens.truncated
        if tokens.rejected is not None:
            rejected[tokens.rejected] += 1
            examples[tokens.rejected] = (examples.get(tokens.rejected, []) + [sample_id])[:REJECTED_EXAMPLES]
            continue
        sample_ids.append(sample_id)
        input_ids.append(tokens.input_ids)
        loss_mask.append(tokens.loss_mask)
    examples = {k: examples[k] for k in REJECT_REASONS if k in examples}  # in REJECT_REASONS order
    return TokenizedConversations(sample_ids, input_ids, loss_mask, rejected, truncated, duplicates, examples)
