"""The models an evaluation decodes with: the target (over ``EvalSettings.gpus`` GPUs), the draft on the
target's output device, and the tokenizer with its chat template (docs/evaluation.md;
the draft reads the target's hidden states as in "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.config import to_dict
from specdraft.configs.evaluation import EvalSettings
from specdraft.decoding.prompt_lookup import prompt_lookup_generate
from specdraft.decoding.speculative import eos_token_ids, speculative_generate, vanilla_generate
from specdraft.configs.decode import DecodeConfig
from specdraft.evaluation.questions import render_prompt
from specdraft.models import check_draft_target, load_draft
from specdraft.placement import output_device, resolve_device, resolve_dtype
from specdraft.configs.devices import MASK_ATTN_IMPLEMENTATIONS
from specdraft.targets import Target
from specdraft.targets.identity import TargetMismatch
from specdraft.targets.loading import load_target_model, load_tokenizer


@dataclass
class Models:
    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: Any
    eos_ids: frozenset[int]


def load_models(target_dir: Target | str | Path, draft_dir: str | Path, settings: EvalSettings) -> Models:
    """Target (full model, over ``settings.gpus`` GPUs), draft and tokenizer in the settings' dtype.

    The draft lives on the target's output device (its lm_head's GPU): the hidden states it reads
    and the logits acceptance compares come out there. The draft is checked against the target first
    (``check_draft_target``: ``TargetMismatch`` naming both fingerprints), before any model loads.
    """
    target_dir = Target.of(target_dir)  # checked here once, not again by the pairing check and each load
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
    if draft.config.vocab_size != vocab or draft.config.hidden_size != target.config.hidden_size:
        raise TargetMismatch(f"draft {draft_dir} (vocab {draft.config.vocab_size}, d {draft.config.hidden_size}) does "
                             f"not match the target {target_dir} (vocab {vocab}, d {target.config.hidden_size})")
    return Models(target, draft, tokenizer, eos_token_ids(target, tokenizer))


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A sampling generator on ``device`` (where logits are sampled: the lm_head's device)."""
    return torch.Generator(device=device).manual_seed(seed)


def warmup(models: Models, settings: EvalSettings) -> None:
    """Untimed short generations so the first timed turn pays no first-call costs."""
    cfg = DecodeConfig(**{**to_dict(settings.decode), "max_new_tokens": min(8, settings.decode.max_new_tokens)})
    ids = render_prompt(models.tokenizer, [{"role": "user", "content": "Hello."}])
    device = output_device(models.target)  # where logits are sampled
    vanilla_generate(models.target, ids, cfg, models.eos_ids, generator(0, device))
    speculative_generate(models.target, models.draft, ids, cfg, models.eos_ids, generator(0, device))
    if settings.pld.enabled:
        prompt_lookup_generate(models.target, ids, cfg, settings.pld, models.eos_ids, generator(0, device))
