"""Draft models and their directory format (``config.json`` + ``model.safetensors``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file

from specdraft.config import from_dict, to_dict
from specdraft.models.beagle import BeagleDraft
from specdraft.models.config import DraftConfig, draft_config_from_target
from specdraft.models.eagle import EagleDraft
from specdraft.models.layers import KV, KVCache


class Draft(Protocol):
    """The seam every stage sees: a parallel forward over versioned states, plus lm_head."""

    config: DraftConfig

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        states: torch.Tensor,
        query_index: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


ARCHS = {"beagle": BeagleDraft, "eagle": EagleDraft}


def build_draft(config: DraftConfig, embed: torch.Tensor | None = None, lm_head: torch.Tensor | None = None):
    """A fresh draft of ``config.arch``; copies the target's frozen embedding / lm_head when given."""
    draft = ARCHS[config.arch](config)
    with torch.no_grad():
        if embed is not None:
            assert embed.shape == draft.embed.weight.shape, f"embed {tuple(embed.shape)} != {tuple(draft.embed.weight.shape)}"
            draft.embed.weight.copy_(embed)
        if lm_head is not None:
            assert lm_head.shape == draft.lm_head.weight.shape, (
                f"lm_head {tuple(lm_head.shape)} != {tuple(draft.lm_head.weight.shape)}"
            )
            draft.lm_head.weight.copy_(lm_head)
    return draft


def save_draft(draft, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` atomically (temp dir, then rename)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(to_dict(draft.config), indent=2, sort_keys=True))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "arch": draft.config.arch})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_draft(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Rebuild a draft from its directory alone."""
    path = Path(path)
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a draft directory: {name} is missing")
    config = from_dict(DraftConfig, json.loads((path / "config.json").read_text()))
    draft = ARCHS[config.arch](config)
    state = load_file(str(path / "model.safetensors"), device=str(device))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config (missing={missing}, unexpected={unexpected})")
    draft.to(device=device, dtype=dtype) if dtype is not None else draft.to(device=device)
    return draft.eval()


__all__ = [
    "ARCHS",
    "KV",
    "BeagleDraft",
    "Draft",
    "DraftConfig",
    "EagleDraft",
    "KVCache",
    "build_draft",
    "draft_config_from_target",
    "load_draft",
    "save_draft",
]
