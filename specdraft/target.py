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
* ``target_fingerprint`` / ``target_id`` / ``check_target``: the target's content fingerprint (a
  digest of its ``config.json`` and its weights' bytes, cached beside the model), the identity string derived from it that
  keys every stage, and the check every consumer of an artifact (regenerated answers, a store, a
  draft) makes before its expensive part: the artifact was made from this target (docs/guarantees.md).

Only local directories are read here; fetching a hub id is the caller's job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from specdraft.chat import ensure_chat_template
from specdraft.checkpoint import (
    INDEX_FILE,
    TargetWeightsError,
    check_loading_info,
    target_dir,
    tensor_locations,
    weight_files,
)
from specdraft.files import write_text
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


def load_target_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's ``transformers`` config, read from ``path/config.json``."""
    return AutoConfig.from_pretrained(target_dir(path), trust_remote_code=trust_remote_code)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The target's tokenizer with its chat template (the plain-text fallback when it ships none)."""
    return ensure_chat_template(AutoTokenizer.from_pretrained(target_dir(path), trust_remote_code=trust_remote_code))


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
    root = target_dir(path)
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


# --- embedding and lm_head from safetensors ------------------------------------------------


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
    root = target_dir(path)
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

FINGERPRINT_CACHE = ".specdraft-fingerprint.json"  # beside the weights (hidden: readers skip it)
FINGERPRINT_BLOCK = 16 << 20  # bytes read per step: large blocks, one thread per file


class TargetMismatch(ValueError):
    """An artifact (regenerated answers, a feature store, a draft) made from another target than ``--target``."""


def _file_key(file: Path) -> dict[str, int]:
    st = file.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _file_digest(file: Path) -> str:
    """sha256 of one file's bytes, streamed in ``FINGERPRINT_BLOCK`` blocks (hashlib drops the GIL)."""
    digest, buf = hashlib.sha256(), bytearray(FINGERPRINT_BLOCK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _cache_paths(root: Path) -> list[Path]:
    """Where a target's fingerprint cache may live: beside the weights, else (a read-only directory)
    under ``$XDG_CACHE_HOME/specdraft`` (default ``~/.cache/specdraft``), keyed by the resolved path."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdraft" / "fingerprints"
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:24]
    return [root / FINGERPRINT_CACHE, home / f"{key}.json"]


def _read_cache(root: Path) -> list[dict[str, Any]]:
    """The cached per-file entries of every cache of ``root`` (beside it first)."""
    caches = []
    for path in _cache_paths(root):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("files"), dict):
            caches.append(data["files"])
    return caches


def _write_cache(root: Path, files: dict[str, Any]) -> None:
    text = json.dumps({"algorithm": "sha256", "files": files}, indent=1, sort_keys=True) + "\n"
    for path in _cache_paths(root):
        try:
            write_text(path, text)
            return
        except OSError:  # a read-only model directory: the user cache next
            continue


def target_fingerprint(path: str | Path) -> str:
    """The target's content fingerprint ``"sha256:<hex>"``: a digest of its ``config.json`` bytes and of its
    weights' (``weights_fingerprint``), so a checkpoint under another config (a layer count that is not its
    own) is another target, and a copy of both elsewhere the same one."""
    root = target_dir(path)
    digest = hashlib.sha256(b"config.json\0" + (root / "config.json").read_bytes() + b"\0")
    digest.update(weights_fingerprint(root).encode())
    return f"sha256:{digest.hexdigest()}"


def weights_fingerprint(path: str | Path) -> str:
    """A digest ``"sha256:<hex>"`` of the target's weights' bytes (all a target fingerprint was before it
    covered ``config.json``).

    It covers every ``*.safetensors`` file (name, size and the sha256 of its bytes), so a model
    updated in place, or another checkpoint of the same shape, has another fingerprint, and a copy of
    the same weights elsewhere the same one. Each file's digest is computed once (files in parallel,
    streamed in large blocks) and cached in ``FINGERPRINT_CACHE`` beside the weights (or, when the
    directory is read-only, under ``~/.cache/specdraft``) keyed by the file's name, size and mtime:
    a file rewritten in place is hashed again.
    """
    root = target_dir(path)
    files = weight_files(root)
    cached = _read_cache(root)
    entries: dict[str, dict[str, Any]] = {}
    todo: list[tuple[Path, dict[str, int]]] = []
    for file in files:
        key = _file_key(file)
        hits = [c[file.name] for c in cached if isinstance(c.get(file.name), dict)]
        hit = next((h for h in hits if all(h.get(k) == v for k, v in key.items()) and h.get("sha256")), None)
        if hit is not None:
            entries[file.name] = {**key, "sha256": hit["sha256"]}
        else:
            todo.append((file, key))
    if todo:
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1, 8)) as pool:
            digests = list(pool.map(_file_digest, [file for file, _ in todo]))
        for (file, key), digest in zip(todo, digests):
            entries[file.name] = {**key, "sha256": digest}
        if all(_file_key(file) == key for file, key in todo):  # none rewritten while it was read
            _write_cache(root, entries)
    overall = hashlib.sha256()
    for name in sorted(entries):
        overall.update(f"{name}\0{entries[name]['size']}\0{entries[name]['sha256']}\n".encode())
    return f"sha256:{overall.hexdigest()}"


def target_id(path: str | Path) -> str:
    """A stable identity ``"<dir name>@<sha256 prefix>"`` for a target directory: part of every stage key.

    The digest covers ``config.json`` and the weights' content (``weights_fingerprint``), so a model
    updated in place (or its config edited) gets a new id.
    """
    root = target_dir(path)
    digest = hashlib.sha256()
    digest.update(b"config.json\0" + (root / "config.json").read_bytes())
    digest.update(b"weights\0" + weights_fingerprint(root).encode())  # the id as before config.json joined it
    return f"{root.resolve().name}@{digest.hexdigest()[:16]}"


def layout_id(path: str | Path) -> str:
    """The identity of specdraft before content fingerprints: ``config.json``, the index file and the
    name and size of every safetensors file (not the weights). Only to check artifacts written then."""
    root = target_dir(path)
    digest = hashlib.sha256()
    digest.update(b"config.json\0" + (root / "config.json").read_bytes())
    index = root / INDEX_FILE
    if index.is_file():
        digest.update(INDEX_FILE.encode() + b"\0" + index.read_bytes())
    for file in weight_files(root):
        digest.update(f"{file.name}\0{file.stat().st_size}\0".encode())
    return f"{root.resolve().name}@{digest.hexdigest()[:16]}"


def target_record(path: str | Path) -> dict[str, str]:
    """What an artifact records of the target it was made from: ``target_id`` and ``target_fingerprint``."""
    return {"target_id": target_id(path), "target_fingerprint": target_fingerprint(path)}


def check_target(artifact: str | Path, recorded: Mapping[str, Any], target: str | Path, *, what: str = "artifact",
                 legacy_mismatch: str = "warn") -> None:
    """Check that ``artifact`` (its recorded ``target_fingerprint`` / ``target_id``) was made from ``target``.

    A recorded fingerprint must equal the target's: else ``TargetMismatch`` naming the artifact's path
    and fingerprint and the target's. An artifact written before fingerprints (none recorded) loads
    with a one-line warning, checked by its target id as then: a mismatch is a warning, or with
    ``legacy_mismatch="error"`` (where that id was checked before) an error.
    """
    assert legacy_mismatch in ("warn", "error"), f"legacy_mismatch={legacy_mismatch!r}: 'warn' or 'error'"
    root = target_dir(target)
    recorded_fp, recorded_id = recorded.get("target_fingerprint") or "", recorded.get("target_id") or ""
    if recorded_fp:
        ours = target_fingerprint(root)
        # written when the fingerprint covered the weights only: its target id (unchanged) covers config.json
        earlier = recorded_fp == weights_fingerprint(root) and recorded_id.split("@")[-1] == target_id(root).split("@")[-1]
        if recorded_fp != ours and not earlier:
            raise TargetMismatch(
                f"{what} {artifact} was made from target {recorded_id or '?'} (fingerprint {recorded_fp}), but "
                f"--target {root.resolve()} is {target_id(root)} (fingerprint {ours}): give the {what}'s own "
                f"target, or remake the {what} from this one"
            )
        return
    if recorded_id and recorded_id == target_id(root):  # a content-derived id: as good as the fingerprint
        return
    legacy = layout_id(root)
    if recorded_id == legacy:
        _warn(f"{what} {artifact} records no target fingerprint (written before fingerprints): checked by its "
              f"target id {recorded_id} only (config and file sizes, not the weights)")
        return
    message = (f"{what} {artifact} records no target fingerprint (written before fingerprints) and its target id "
               f"{recorded_id or '(none)'} is not that of --target {root.resolve()} ({legacy})")
    if legacy_mismatch == "error":
        raise TargetMismatch(f"{message}: give the {what}'s own target, or remake the {what} from this one")
    _warn(f"{message}: its pairing with the target is not verified")


def _warn(line: str) -> None:
    print(f"[specdraft] WARNING: {line}", file=sys.stderr, flush=True)
