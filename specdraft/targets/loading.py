"""Loading a target (``specdraft.targets.Target``): its ``transformers`` config and tokenizer (cached on the
``Target``: read once a run), the tokenizer's facts, its frozen token embedding ``e`` and ``lm_head`` read
straight from the safetensors files (single or sharded, tied or not) without instantiating the model — the
drafts reuse both ("EAGLE", §3) — and the full model, frozen, loaded strictly (``checkpoint.check_loading_info``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from specdraft.chat import ensure_chat_template
from specdraft.placement import (
    check_spread,
    device_map_for,
    free_gpu_memory,
    resolve_attn_implementation,
    resolve_device,
    resolve_dtype,
)
from specdraft.targets import Target
from specdraft.targets.checkpoint import check_loading_info, tensor_locations

EMBED_NAME = "model.embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
EMBED_SUFFIX = "embed_tokens.weight"
LM_HEAD_SUFFIX = "lm_head.weight"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TargetHeads:
    """The target's frozen input embedding and output projection, both ``(V, d)``."""

    embed: torch.Tensor  # (V, d)
    lm_head: torch.Tensor  # (V, d)
    tied: bool = False


def load_target_config(target: Target | str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's ``transformers`` config, read from its ``config.json`` once per ``Target`` (shared: read it,
    never change it)."""
    target = Target.of(target)
    return target.cached(("config", trust_remote_code),
                         lambda: AutoConfig.from_pretrained(target.path, trust_remote_code=trust_remote_code))


def load_tokenizer(target: Target | str | Path, trust_remote_code: bool = False):
    """The target's tokenizer with its chat template (the plain-text fallback when it ships none); a new one at
    each call (callers set its padding side)."""
    root = Target.of(target).path
    return ensure_chat_template(AutoTokenizer.from_pretrained(root, trust_remote_code=trust_remote_code))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerFacts:
    """What a stage asks of the target's tokenizer without using it: its size, ends of turn and template."""

    vocab_size: int  # len(tokenizer): the ids it can produce, added tokens included
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    chat_template: bool  # the target ships one (else ``specdraft.chat``'s plain-text fallback is applied)


def tokenizer_facts(target: Target | str | Path, trust_remote_code: bool = False) -> TokenizerFacts:
    """``TokenizerFacts`` of the target's tokenizer, read once per ``Target``."""
    target = Target.of(target)

    def read() -> TokenizerFacts:
        raw = AutoTokenizer.from_pretrained(target.path, trust_remote_code=trust_remote_code)
        shipped = bool(raw.chat_template)
        eos = raw.eos_token_id
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return TokenizerFacts(vocab_size=len(raw), eos_token_ids=frozenset(int(i) for i in ids),
                              pad_token_id=raw.pad_token_id, chat_template=shipped)

    return target.cached(("tokenizer_facts", trust_remote_code), read)


def load_target_model(
    target: Target | str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    *,
    gpus: int = 1,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """The full target as an ``AutoModelForCausalLM``, frozen and in eval mode.

    ``device``: ``"auto"`` | ``"cpu"`` | ``"cuda"`` | ``"cuda:N"``; the weights are loaded straight
    onto it (a ``device_map``, no CPU copy first). ``gpus`` > 1 spreads whole decoder layers over
    GPUs 0..gpus-1 (transformers' balanced ``device_map``; a target that does not fit is an error,
    never a CPU offload): inputs then go to ``placement.input_device(model)``, hidden states and
    logits come out on ``placement.output_device(model)``. ``dtype``: a dtype or its name
    (``"auto"``: bf16 on CUDA, fp32 on CPU). ``attn_implementation``: ``"sdpa"`` |
    ``"flash_attention_2"`` (CUDA with flash-attn, else sdpa) | ``"eager"``; the kernel in use is
    ``model.config._attn_implementation``. All placement rules: ``specdraft/placement.py``.
    """
    root = Target.of(target).path
    device = resolve_device(device)
    device_map, max_memory = device_map_for(device, gpus, free_gpu_memory(gpus) if gpus > 1 else None)
    model, info = AutoModelForCausalLM.from_pretrained(
        root,
        dtype=resolve_dtype(dtype, device),
        device_map=device_map,
        max_memory=max_memory,
        attn_implementation=resolve_attn_implementation(attn_implementation, device),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,  # one loading path for every command: a pickle (.bin) checkpoint is refused, never run
        output_loading_info=True,
    )
    check_loading_info(root, info)  # strict: weights the config has no place for, or places left empty, refused
    if gpus > 1:
        check_spread(getattr(model, "hf_device_map", {}), gpus)
    model.eval()
    model.requires_grad_(False)
    return model


def _find_key(names: list[str], exact: str, suffix: str) -> str | None:
    """``exact`` if present, else the one name ending with ``suffix``; ``None`` if none does."""
    if exact in names:
        return exact
    matches = sorted(n for n in names if n.endswith(suffix))
    if len(matches) > 1:
        raise ValueError(f"several tensors end with {suffix!r}: {matches}; cannot pick one")
    return matches[0] if matches else None


def _config_says_tied(root: Path) -> bool:
    """Whether ``config.json`` (or its ``text_config``) sets ``tie_word_embeddings``."""
    config = json.loads((root / "config.json").read_text())
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(config.get("text_config", {}).get("tie_word_embeddings", False))


def _read_tensor(file: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    if not file.is_file():
        raise FileNotFoundError(f"shard {str(file)!r} (holding {name!r}) is missing")
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(name).to(dtype)


def load_target_heads(target: Target | str | Path, dtype: torch.dtype = torch.float32) -> TargetHeads:
    """Read only the target's embedding and lm_head from its safetensors (no model is built).

    Works for a single ``model.safetensors`` or a sharded checkpoint (only the shards holding
    the two tensors are opened). ``lm_head`` is the embedding when the config ties them or the
    checkpoint stores no lm_head tensor.
    """
    root = Target.of(target).path
    locations = tensor_locations(root)
    names = sorted(locations)
    embed_key = _find_key(names, EMBED_NAME, EMBED_SUFFIX)
    if embed_key is None:
        candidates = [n for n in names if "embed" in n or "wte" in n] or names[:20]
        raise KeyError(
            f"no {EMBED_NAME!r} (or key ending with {EMBED_SUFFIX!r}) in {str(root)!r}; "
            f"candidate keys: {candidates}"
        )
    head_key = _find_key(names, LM_HEAD_NAME, LM_HEAD_SUFFIX)
    tied = _config_says_tied(root) or head_key is None

    embed = _read_tensor(locations[embed_key], embed_key, dtype)  # (V, d)
    lm_head = embed if tied else _read_tensor(locations[head_key], head_key, dtype)  # (V, d)
    if embed.dim() != 2 or embed.shape != lm_head.shape:
        raise ValueError(
            f"expected embed and lm_head of the same shape (V, d); got "
            f"{tuple(embed.shape)} ({embed_key}) and {tuple(lm_head.shape)} ({head_key})"
        )
    return TargetHeads(embed=embed, lm_head=lm_head, tied=tied)
