"""The target: the served LLM a draft learns to predict ("EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", §3: the draft reads the target's features and reuses its embedding and lm_head).

Everything the system needs from the served LLM (the *target*), as plain functions:

* ``load_target_config`` / ``load_tokenizer``: its HF config and tokenizer (its chat template, or
  ``specdraft.chat``'s plain-text fallback when it has none);
* ``load_target_heads``: its frozen token embedding ``e`` and ``lm_head``, read straight from the
  safetensors files (single or sharded, tied or not) without instantiating the model — the
  drafts reuse both;
* ``load_target_model`` / ``target_states``: the full model and, for a batch, its last hidden
  state (the tensor its lm_head consumes, i.e. after the final norm) and its logits;
  ``target_features`` adds the auxiliary states of chosen layers (EAGLE-3 features, ``aux_states``,
  the same capture decoding's ``verify.target_forward`` uses). What is stored per token from one
  prefill, and the auxiliary layers' resolution, is ``specdraft.features``';
* ``target_id``: a stable identity string for a target directory, for store manifests.

Only local directories are read here; fetching a hub id is the caller's job.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
    input_device,
    output_device,
    resolve_attn_implementation,
    resolve_device,
    resolve_dtype,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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


# --- config, tokenizer, model -------------------------------------------------------------


def _target_dir(path: str | Path) -> Path:
    """``path`` as a ``Path``, after checking it is a directory holding a ``config.json``."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"target {str(path)!r} is not a local directory")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"target directory {str(root)!r} has no config.json")
    return root


def load_target_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's ``transformers`` config, read from ``path/config.json``."""
    return AutoConfig.from_pretrained(_target_dir(path), trust_remote_code=trust_remote_code)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer with its chat template (the plain-text fallback when it ships none)."""
    return ensure_chat_template(AutoTokenizer.from_pretrained(_target_dir(path), trust_remote_code=trust_remote_code))


def load_target_model(
    path: str | Path,
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
    root = _target_dir(path)
    device = resolve_device(device)
    device_map, max_memory = device_map_for(device, gpus, free_gpu_memory(gpus) if gpus > 1 else None)
    model = AutoModelForCausalLM.from_pretrained(
        root,
        dtype=resolve_dtype(dtype, device),
        device_map=device_map,
        max_memory=max_memory,
        attn_implementation=resolve_attn_implementation(attn_implementation, device),
        trust_remote_code=trust_remote_code,
        use_safetensors=True,  # one loading path for every command: a pickle (.bin) checkpoint is refused, never run
    )
    if gpus > 1:
        check_spread(getattr(model, "hf_device_map", {}), gpus)
    model.eval()
    model.requires_grad_(False)
    return model


# --- embedding and lm_head from safetensors ------------------------------------------------


def _tensor_locations(root: Path) -> dict[str, Path]:
    """Map every tensor name in the target's safetensors to the file that holds it."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        return {name: root / shard for name, shard in weight_map.items()}
    single = root / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in root.iterdir() if p.is_file())
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {str(root)!r} (found {found}); "
        "only safetensors checkpoints are supported"
    )


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


def load_target_heads(path: str | Path, dtype: torch.dtype = torch.float32) -> TargetHeads:
    """Read only the target's embedding and lm_head from its safetensors (no model is built).

    Works for a single ``model.safetensors`` or a sharded checkpoint (only the shards holding
    the two tensors are opened). ``lm_head`` is the embedding when the config ties them or the
    checkpoint stores no lm_head tensor.
    """
    root = _target_dir(path)
    locations = _tensor_locations(root)
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


# --- hidden states and logits ---------------------------------------------------------------


def aux_states(hidden_states: tuple[torch.Tensor, ...], aux_layers: list[int] | tuple[int, ...],
               device: torch.device | str) -> torch.Tensor:
    """The EAGLE-3 features: the states ``hidden_states[i]`` (a decoder's ``output_hidden_states``)
    for ``i`` in ``aux_layers``, concatenated on ``device`` -> (B, T, L*d)."""
    assert aux_layers, "aux_states needs at least one layer"
    return torch.cat([hidden_states[i].to(device) for i in aux_layers], dim=-1)  # (B, T, L*d)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting only attended tokens, so left-padded rows start at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)


@torch.no_grad()
def target_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's last hidden state (post final norm) ``(B, T, d)`` and logits ``(B, T, V)``.

    ``target_features`` without auxiliary layers; see there.
    """
    hidden, logits, _ = target_features(model, input_ids, attention_mask)
    return hidden, logits


@torch.no_grad()
def target_features(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    aux_layers: list[int] | tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Last hidden state ``(B, T, d)``, logits ``(B, T, V)`` and, with ``aux_layers``, the auxiliary
    states ``(B, T, L*d)`` (``aux_states``; else None) of one prefill.

    Runs the decoder stack once and applies the lm_head to its ``last_hidden_state`` so the
    returned hidden is exactly what produced the logits. Padded positions (``attention_mask``
    0) get zero states (hence zero logits); valid positions of a left-padded row equal
    those of the same row unpadded. Inputs may live anywhere; all outputs are on the model's
    ``output_device`` (a target spread over GPUs: the last one).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T); got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)  # (B, T)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} does not match "
            f"input_ids {tuple(input_ids.shape)}"
        )
    decoder = model.get_decoder()
    lm_head = model.get_output_embeddings()
    if decoder is model or lm_head is None:
        raise ValueError(f"{type(model).__name__} has no separate decoder and lm_head")

    device = input_device(model)  # a target spread over GPUs starts at its embedding's GPU
    out = decoder(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=positions_from_mask(attention_mask).to(device),
        use_cache=False,
        output_hidden_states=bool(aux_layers),
    )
    home = output_device(model)
    hidden = out.last_hidden_state.to(home)  # (B, T, d): on the lm_head's device
    valid = attention_mask.to(hidden.device, torch.bool)[..., None]  # (B, T, 1)
    zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
    hidden = torch.where(valid, hidden, zero)  # (B, T, d)
    logits = lm_head(hidden)  # (B, T, V)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap  # (B, T, V)
    aux = None
    if aux_layers:
        aux = torch.where(valid, aux_states(out.hidden_states, aux_layers, home), zero)  # (B, T, L*d)
    return hidden, logits, aux


# --- identity -------------------------------------------------------------------------------


def target_id(path: str | Path) -> str:
    """A stable identity ``"<dir name>@<sha256 prefix>"`` for a target directory.

    The digest covers ``config.json`` and the safetensors layout (the index file's bytes, and
    the name and size of every ``*.safetensors`` file), not the weights themselves, so it is
    cheap for any model size and changes whenever the checkpoint does.
    """
    root = _target_dir(path)
    digest = hashlib.sha256()
    digest.update(b"config.json\0" + (root / "config.json").read_bytes())
    index = root / INDEX_FILE
    if index.is_file():
        digest.update(INDEX_FILE.encode() + b"\0" + index.read_bytes())
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {str(root)!r}")
    for file in files:
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
    return f"{root.resolve().name}@{digest.hexdigest()[:16]}"
