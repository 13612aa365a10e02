"""Where the target runs: device, dtype, attention kernel and its spread over GPUs (docs/operations.md "Targets
larger than one GPU").

The placement decisions of every stage that runs the target (dump prefill, HF regeneration,
evaluation), in one place; ``target.load_target_model`` applies them:

* ``resolve_device`` / ``resolve_dtype``: ``"auto"`` means CUDA when present (bf16 there), else
  the CPU (fp32); ``resolve_dtype`` is the one place a dtype name (``DTYPES``) becomes a dtype,
  ``dtype_name`` the way back;
* ``resolve_attn_implementation``: ``sdpa`` (default), ``flash_attention_2`` when requested on
  CUDA with ``flash_attn`` importable (otherwise ``sdpa``), or ``eager``;
* ``spread_gpus``: the GPUs a Ray actor asks for (``num_gpus``) read as the number of GPUs its
  target is spread over — a fraction shares one GPU, a whole N > 1 splits the layers over N;
* ``device_map_for``: the ``device_map`` / ``max_memory`` for ``from_pretrained``: the whole
  model on one device, or transformers' balanced split of whole decoder layers over GPUs
  0..N-1 (those a Ray actor holding N GPUs sees), with no CPU or disk offload;
* ``input_device`` / ``output_device``: where a (possibly spread) target takes its token ids
  (its embedding's device) and where its last hidden state and logits come out (its lm_head's
  device — also where the draft lives during speculative decoding);
* ``host_ids``: token ids or indices the host decided (a round's accepted path) on a device without
  waiting for the device's queued work;
* ``describe_placement``: the effective kernel, dtype and devices, for manifests and reports.

A target spread with a ``device_map`` carries accelerate's hooks, which move activations (and
the attention mask and rotary embeddings) from one GPU to the next and leave each layer's KV
cache on its own GPU; callers only move inputs to ``input_device`` and read outputs on
``output_device``.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any, Mapping

import torch

from specdraft.config import ConfigError
from specdraft.configs.devices import ATTN_IMPLEMENTATIONS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> ``cuda`` when available, else ``cpu``; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` as given."""
    if isinstance(name, torch.device):
        device = name
    elif name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {str(name)!r}")
    return device


def resolve_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """Inference dtype: ``"auto"`` -> bf16 on CUDA, fp32 on CPU; else the named (or given) dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: str | torch.dtype) -> str:
    """The name ``resolve_dtype`` takes for a dtype (``torch.bfloat16`` -> ``"bfloat16"``); a name as given."""
    return str(dtype).removeprefix("torch.")


def resolve_attn_implementation(requested: str, device: str | torch.device) -> str:
    """The attention kernel to load the target with.

    ``flash_attention_2`` only on CUDA with the ``flash_attn`` package importable (it handles
    padding by unpadding, never a mask); otherwise ``sdpa`` with a warning. ``sdpa`` gets a
    boolean (B, 1, T, T) mask only when there is padding (``is_causal`` otherwise); ``eager`` is
    the fallback for models without an SDPA path.
    """
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {requested!r}")
    if requested == "flash_attention_2":
        if resolve_device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            return requested
        warnings.warn(
            f"attn_implementation='flash_attention_2' needs CUDA and the flash-attn package "
            f"(device {str(device)!r}); loading the target with 'sdpa'",
            stacklevel=2,
        )
        return "sdpa"
    return requested


def free_gpu_memory(gpus: int) -> dict[int, int]:
    """Free bytes on each of the first ``gpus`` visible GPUs (the ``max_memory`` of a spread load)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible < gpus:
        raise ValueError(
            f"the target is to be spread over {gpus} GPUs but this process sees {visible} "
            "(a Ray actor sees the GPUs it requested: num_gpus / gpus_per_actor must match)"
        )
    return {i: int(torch.cuda.mem_get_info(i)[0]) for i in range(gpus)}


def device_map_for(
    device: torch.device, gpus: int = 1, gpu_memory: Mapping[int, int | str] | None = None
) -> tuple[dict[str, Any] | str, dict[int, int | str] | None]:
    """``(device_map, max_memory)`` for ``AutoModelForCausalLM.from_pretrained``.

    One device (``gpus == 1``): ``{"": device}`` — every weight is loaded straight onto it.
    ``gpus`` N > 1: ``"auto"`` (transformers' balanced split, whole decoder layers per GPU) with
    ``max_memory`` = ``gpu_memory`` for GPUs 0..N-1 only — no other GPU, no CPU: a target that
    does not fit is an error (``check_spread``), never a silent offload.
    """
    assert gpus >= 1, f"gpus must be >= 1, got {gpus}"
    if gpus == 1:
        return {"": device}, None
    assert device.type == "cuda" and device.index is None, (
        f"gpus={gpus} spreads the target over cuda:0..cuda:{gpus - 1}; device must be 'auto' or 'cuda', got {device}"
    )
    assert gpu_memory is not None and sorted(gpu_memory) == list(range(gpus)), (
        f"gpu_memory must name GPUs 0..{gpus - 1}, got {None if gpu_memory is None else sorted(gpu_memory)}"
    )
    return "auto", dict(gpu_memory)


def check_spread(device_map: Mapping[str, Any], gpus: int) -> None:
    """Raise unless every module of a spread model sits on one of GPUs 0..gpus-1."""
    allowed = {*range(gpus), *(f"cuda:{i}" for i in range(gpus)), *(torch.device("cuda", i) for i in range(gpus))}
    off = {name: str(where) for name, where in device_map.items() if where not in allowed}
    if off:
        raise ValueError(
            f"the target does not fit on {gpus} GPUs: {sorted(off.items())[:8]} would be offloaded; "
            "use more GPUs per actor or a smaller dtype"
        )


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model takes its token ids: its input embedding's device (any module: its first parameter's)."""
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if get is not None else None
    if embed is not None and getattr(embed, "weight", None) is not None:
        return embed.weight.device
    return next(model.parameters()).device


def output_device(model: torch.nn.Module) -> torch.device:
    """Where the model's logits come out: its lm_head's device (any module: its last parameter's)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.device
    return list(model.parameters())[-1].device


def host_ids(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as a (L,) long tensor on ``device``. On CUDA through pinned memory and a non-blocking copy:
    a copy from pageable memory waits for every kernel queued before it (a host synchronisation, in a
    decoding round whose one synchronisation is its acceptance's read); PyTorch's pinned allocator keeps
    the staging block until the copy is done."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


def describe_placement(model: torch.nn.Module) -> dict[str, Any]:
    """The effective attention kernel, dtype and devices of a loaded target (JSON-able)."""
    params = list(model.parameters())
    return {
        "attn_implementation": getattr(getattr(model, "config", None), "_attn_implementation", None),
        "dtype": dtype_name(params[0].dtype),
        "devices": sorted({str(p.device) for p in params}),
        "input_device": str(input_device(model)),
        "output_device": str(output_device(model)),
    }
