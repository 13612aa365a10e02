"""The target's states for a batch ("EAGLE", §3; "EAGLE-3", §3: the draft reads the target's features): one
prefill's last hidden state (the tensor its lm_head consumes, i.e. after the final norm), its logits and the
auxiliary states of chosen layers (``aux_states``, the same capture decoding's ``verify.target_forward``
uses). What is stored per token from one prefill, and the auxiliary layers' resolution, is
``specdraft.features``'.
"""

from __future__ import annotations

import torch

from specdraft.placement import input_device, output_device

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
    states ``(B, T, L*d)`` (``aux_states``; else None) of one prefill: ``target_hidden`` then
    ``target_logits`` of its hidden, so the returned hidden is exactly what produced the logits.
    Padded positions (``attention_mask`` 0) get zero states (hence zero logits)."""
    hidden, aux = target_hidden(model, input_ids, attention_mask, aux_layers)
    return hidden, target_logits(model, hidden), aux


@torch.no_grad()
def target_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    aux_layers: list[int] | tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Last hidden state ``(B, T, d)`` (after the final norm: what the lm_head consumes) and, with
    ``aux_layers``, the auxiliary states ``(B, T, L*d)`` (``aux_states``; else None) of one prefill —
    the decoder stack once, no lm_head (``target_logits`` applies it, to the rows a caller keeps).

    Padded positions (``attention_mask`` 0) get zero states; valid positions of a left-padded row
    equal those of the same row unpadded. Inputs may live anywhere; all outputs are on the model's
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
    if decoder is model or model.get_output_embeddings() is None:
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
    aux = None
    if aux_layers:
        aux = torch.where(valid, aux_states(out.hidden_states, aux_layers, home), zero)  # (B, T, L*d)
    return hidden, aux


@torch.no_grad()
def target_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits ``(..., V)`` of last hidden states ``(..., d)`` (``target_hidden``'s): its lm_head and,
    where the model has one, its final logit soft-capping."""
    logits = model.get_output_embeddings()(hidden)  # (..., V)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap  # (..., V)
    return logits
