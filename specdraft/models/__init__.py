"""Draft models and their directory format (``config.json`` + ``model.safetensors``).

A draft directory holds the draft's own weights (and, with a draft vocabulary, its ``d2t``/``t2d``
maps). The target's frozen embedding and lm_head are *referenced*, not copied (``config.target_id`` and
``config.target_fingerprint`` say which target; ``check_draft_target`` compares them with a target
directory, and ``load_draft(target=...)`` does before loading): ``load_draft`` takes them from the target (``target=`` a model directory, or
``heads=`` tensors already in memory). ``save_draft(..., include_heads=True)`` writes a
self-contained directory for tools that cannot reach the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specdraft.config import from_dict, to_dict
from specdraft.files import write_directory
from specdraft.models.beagle import BeagleDraft
from specdraft.models.config import draft_config_from_target
from specdraft.configs.draft import DraftConfig
from specdraft.models.dflash import DFlashDraft
from specdraft.models.eagle import EagleDraft
from specdraft.models.heads import Heads
from specdraft.models.kvcache import KVCache
from specdraft.models.layers import KV, Chain

EMBED_KEY, LM_HEAD_KEY = "heads.embed_weight", "heads.lm_head_weight"  # only in self-contained directories
LEGACY_KEYS = {"embed.weight": EMBED_KEY, "lm_head.weight": LM_HEAD_KEY}  # specdraft 0.1 names


class Draft(Protocol):
    """The seam every stage sees. Training: a sub-step forward (``__call__``), the feature projection,
    the heads. Drafting (``decoding/drafting.py``), over a ``KVCache`` of the draft's own entries:

    * ``encode_committed(tokens, states, start)``: the cache entries of committed true states
      h_start .. h_{start+m-1} (1, m, d), with ``tokens`` (1, m+1) = t_start .. t_{start+m}, and the
      input of the root query (the last token's);
    * ``encode_nodes(tokens, parent_states, positions)``: drafted nodes' query inputs, and the
      entries they add before their query (seen by each node itself and its descendants), or None
      (``parent_states`` is None for a draft whose ``config.reads_parent_states`` is False);
    * ``attend(x, positions, kv, visible)``: predicted states (1, Q, d) of queries over the cache;
    * ``encode_drafted(h, positions)``: the entries a node's predicted state adds after its query
      (seen by its descendants: Beagle's "concate"), or None.

    A block draft (``DFlashDraft``) trains whole blocks (``forward(input_ids, positions, features,
    anchors)``) and drafts a block at a time over a per-layer context cache (``context_kv`` /
    ``draft_block``, ``decoding/block.py``) instead of the per-token API above.
    """

    config: DraftConfig
    heads: Heads

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        query_index: torch.Tensor,
        cutoff: torch.Tensor,
        extras: torch.Tensor | Chain,
    ) -> torch.Tensor: ...

    def project(self, features: torch.Tensor) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def encode_committed(self, tokens: torch.Tensor, states: torch.Tensor, start: int) -> tuple[torch.Tensor, KV]: ...

    def encode_nodes(
        self, tokens: torch.Tensor, parent_states: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, KV | None]: ...

    def attend(
        self, x: torch.Tensor, positions: torch.Tensor, kv: KV, visible: torch.Tensor, extra: list[KV] | None = None
    ) -> torch.Tensor: ...

    def encode_drafted(self, h: torch.Tensor, positions: torch.Tensor) -> KV | None: ...


ARCHS = {"beagle": BeagleDraft, "eagle": EagleDraft, "eagle3": EagleDraft, "dflash": DFlashDraft}


def build_draft(
    config: DraftConfig,
    embed: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
    vocab: torch.Tensor | None = None,
):
    """A fresh draft of ``config.arch`` with the target's frozen embedding / lm_head attached.

    ``vocab``: the draft vocabulary's target ids (sorted), required with ``draft_vocab_size``; the
    draft's own lm_head then starts from the target's rows of those ids.
    """
    draft = ARCHS[config.arch](config)
    if config.own_vocab:
        assert vocab is not None, "a draft with draft_vocab_size needs its vocabulary (target ids)"
        draft.heads.set_vocab(vocab)
    if embed is not None or lm_head is not None:
        assert embed is not None and lm_head is not None, "give both the target's embedding and lm_head"
        draft.heads.attach(embed, lm_head, init_head=True)
    return draft


def save_draft(
    draft, out_dir: str | Path, include_heads: bool = False, weights: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` atomically (temp dir, then rename).

    ``weights``: the draft's state dict when ``draft`` does not hold it in full (a sharded draft's
    gathered weights, ``Trainer.draft_state_dict``); by default ``draft.state_dict()``.
    """
    with write_directory(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(to_dict(draft.config), indent=2, sort_keys=True))
        weights = draft.state_dict() if weights is None else weights
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items()}
        if include_heads:
            assert draft.heads.attached, "no target heads attached: nothing to include"
            tensors[EMBED_KEY] = draft.heads.embed_weight.detach().cpu().contiguous()
            if not draft.config.own_vocab:
                tensors[LM_HEAD_KEY] = draft.heads.lm_head_weight.detach().cpu().contiguous()
        metadata = {"format": "pt", "arch": draft.config.arch, "heads": "included" if include_heads else "referenced"}
        save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
    return Path(out_dir)


def read_draft_config(path: str | Path) -> DraftConfig:
    """The ``DraftConfig`` of a draft directory (a specdraft 0.1 EAGLE draft reads as ``legacy``)."""
    path = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a draft directory: {name} is missing")
    data = json.loads((path / "config.json").read_text())
    if data.get("arch") == "eagle" and "legacy" not in data:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            data["legacy"] = "input_layernorm.weight" in f.keys()
    return from_dict(DraftConfig, data)


def check_draft_target(path: str | Path, target: str | Path) -> DraftConfig:
    """The draft's config, after checking it was trained on ``target`` (``specdraft.targets.identity.check_pairing``:
    ``TargetMismatch`` naming the draft and both fingerprints; a draft written before fingerprints loads
    with a one-line warning)."""
    from specdraft.targets.identity import check_pairing

    config = read_draft_config(path)
    recorded = {"target_id": config.target_id, "target_fingerprint": config.target_fingerprint}
    check_pairing(path, recorded, target, what="draft")
    return config


def load_draft(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    target: str | Path | None = None,
    heads: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Rebuild a draft from its directory, with the target's heads from the directory itself (when
    saved with them), ``heads`` = (embed, lm_head), or the ``target`` model directory (checked first:
    ``check_draft_target``)."""
    path = Path(path)
    config = read_draft_config(path) if target is None else check_draft_target(path, target)
    draft = ARCHS[config.arch](config)
    state = load_file(str(path / "model.safetensors"), device="cpu")
    state = {LEGACY_KEYS.get(k, k): v for k, v in state.items()}
    embed, lm_head = state.pop(EMBED_KEY, None), state.pop(LM_HEAD_KEY, None)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config (missing={missing}, unexpected={unexpected})")
    if heads is None and target is not None:
        from specdraft.targets.loading import load_target_heads

        loaded = load_target_heads(target)
        heads = (loaded.embed, loaded.lm_head)
    if heads is None and embed is not None:  # a self-contained directory
        heads = (embed, lm_head)
    if heads is not None:
        draft.heads.attach(*heads)
    if not draft.heads.attached:
        raise ValueError(
            f"draft {path} references its target's embedding and lm_head (target {config.target_id or '?'}): "
            "pass the target directory (load_draft(path, target=...), `--target`) or the heads"
        )
    draft.to(device=device, dtype=dtype) if dtype is not None else draft.to(device=device)
    return draft.eval()


def set_frozen_dtype(draft, dtype: torch.dtype) -> None:
    """Cast the draft's frozen target tensors (embedding, shared lm_head, teacher rows) to ``dtype``."""
    draft.heads.set_frozen_dtype(dtype)


__all__ = [
    "ARCHS",
    "KV",
    "BeagleDraft",
    "Draft",
    "DFlashDraft",
    "EagleDraft",
    "KVCache",
    "build_draft",
    "check_draft_target",
    "draft_config_from_target",
    "load_draft",
    "read_draft_config",
    "save_draft",
    "set_frozen_dtype",
]
