"""A padded batch of dumped target features: what the store's reader yields and the objectives consume.

``Batch`` holds one right-padded batch (positions 0..T-1 per row); ``pad_batch`` builds one from
per-sample tensors. Kept apart from the objectives so storage does not import training code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """A padded batch of dumped features. Positions are 0..T-1 per row (right padding).

    The store's reader may hand out a batch still in its stored form — ``hidden`` / ``aux_hidden`` as
    float16 or bfloat16, or int8 codes with ``hidden_scale`` / ``aux_scale`` — so that only the stored
    bytes travel to the device; ``to(device)`` decodes them there to float32 (``decoded`` tells which).
    """

    input_ids: torch.Tensor  # (B, T) int64
    hidden: torch.Tensor  # (B, T, d) true states (what lm_head consumes)
    loss_mask: torch.Tensor  # (B, T) bool: positions whose prediction is trained
    valid: torch.Tensor  # (B, T) bool: non-padding
    topk_ids: torch.Tensor | None = None  # (B, T, K) int64
    topk_logp: torch.Tensor | None = None  # (B, T, K) float: target log-probs of topk_ids
    aux_hidden: torch.Tensor | None = None  # (B, T, L*d) auxiliary target layers (EAGLE-3 features)
    hidden_scale: torch.Tensor | None = None  # (B, T) float32: ``hidden`` holds int8 codes (hidden = codes * scale)
    aux_scale: torch.Tensor | None = None  # (B, T, L) float32: ``aux_hidden`` holds int8 codes, one scale per layer

    @property
    def positions(self) -> torch.Tensor:
        b, t = self.input_ids.shape
        return torch.arange(t, device=self.input_ids.device).expand(b, t)  # (B, T)

    @property
    def decoded(self) -> bool:
        """Whether the features are float32 values (not stored codes awaiting ``to``)."""
        return all(x is None or x.dtype == torch.float32 for x in (self.hidden, self.aux_hidden))

    def to(self, device: torch.device | str) -> "Batch":
        """This batch on ``device``, its features decoded there to float32 (a no-op decode when they are)."""
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        moved = {f: move(getattr(self, f)) for f in self.__dataclass_fields__}
        moved["hidden"] = dequantize_features(moved["hidden"], moved.pop("hidden_scale"))  # (B, T, d)
        if moved["aux_hidden"] is not None:
            moved["aux_hidden"] = dequantize_features(moved["aux_hidden"], moved["aux_scale"])  # (B, T, L*d)
        moved.pop("aux_scale")
        return Batch(**moved)

    def pin_memory(self) -> "Batch":
        """The same batch in page-locked host memory (fast, asynchronous copies to a GPU)."""
        pin = lambda x: None if x is None else x.pin_memory()  # noqa: E731
        return Batch(**{f: pin(getattr(self, f)) for f in self.__dataclass_fields__})


def dequantize_features(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored features -> float32: float16/bfloat16 widened; int8 codes (..., P*w) times their scale
    (..., P) — one scale per slice of width w (P = 1: ``hidden``; P = L layers: ``aux_hidden``)."""
    if values.dtype == torch.int8:
        assert scale is not None, "int8 features need their scale"
        parts = scale.shape[-1] if scale.dim() == values.dim() else 1
        scale = scale if scale.dim() == values.dim() else scale[..., None]  # (..., P)
        shape = values.shape
        return (values.reshape(*shape[:-1], parts, shape[-1] // parts).float() * scale[..., None]).reshape(shape)
    assert scale is None, f"a scale only goes with int8 codes, not {values.dtype}"
    return values.float()


def pad_batch(samples: list[dict[str, torch.Tensor]]) -> Batch:
    """Right-pad per-sample tensors into a ``Batch``.

    Each sample has ``input_ids`` (T,), ``hidden`` (T, d), ``loss_mask`` (T,) and
    optionally ``topk_ids`` / ``topk_logp`` (T, K) and ``aux_hidden`` (T, L*d).
    """
    assert samples, "cannot pad an empty list of samples"
    n, t = len(samples), max(s["input_ids"].shape[0] for s in samples)
    d = samples[0]["hidden"].shape[-1]
    ids = torch.zeros(n, t, dtype=torch.int64)
    hidden = torch.zeros(n, t, d, dtype=torch.float32)
    loss_mask = torch.zeros(n, t, dtype=torch.bool)
    valid = torch.zeros(n, t, dtype=torch.bool)
    has_topk = "topk_ids" in samples[0]
    k = samples[0]["topk_ids"].shape[-1] if has_topk else 0
    topk_ids = torch.zeros(n, t, k, dtype=torch.int64) if has_topk else None
    topk_logp = torch.full((n, t, k), -1e4, dtype=torch.float32) if has_topk else None
    has_aux = "aux_hidden" in samples[0]
    aux = torch.zeros(n, t, samples[0]["aux_hidden"].shape[-1], dtype=torch.float32) if has_aux else None
    for row, s in enumerate(samples):
        m = s["input_ids"].shape[0]
        ids[row, :m] = s["input_ids"]
        hidden[row, :m] = s["hidden"].float()
        loss_mask[row, :m] = s["loss_mask"].bool()
        valid[row, :m] = True
        if has_topk:
            topk_ids[row, :m] = s["topk_ids"]
            topk_logp[row, :m] = s["topk_logp"].float()
        if has_aux:
            aux[row, :m] = s["aux_hidden"].float()
    return Batch(ids, hidden, loss_mask, valid, topk_ids, topk_logp, aux)
