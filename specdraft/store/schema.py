"""Feature-store schema: array names, dtypes and shapes, hidden-state codecs, shard names, digests.

The feature store (docs/concepts.md "The core in one page"): per shard, all sequences concatenated: ``input_ids``
int32 [N], ``loss_mask`` uint8 [N], ``hidden`` [N, d] (codec ``fp16`` float16 | ``bf16`` bfloat16
bits as uint16 | ``int8`` with ``hidden_scale`` float32 [N], lossy), ``topk_ids`` int32 [N, K],
``topk_logits`` float16 [N, K], ``logsumexp`` float32 [N], ``offsets`` int64 [S+1],
``sample_ids`` string [S]; optionally (EAGLE-3 features) ``aux_hidden`` [N, L*d], the states of L
auxiliary target layers in the same codec (int8: ``aux_hidden_scale`` float32 [N, L], one scale per
token and layer), the layer ids (HF ``output_hidden_states`` indices) in the manifest.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from specdraft.batch import dequantize_features
from specdraft.files import temp_path

SCHEMA_VERSION = 1
FORMAT_NAME = "specdraft-features"
MANIFEST_FILE = "manifest.json"
SHARD_ATTR = "specdraft_shard"
HIDDEN_CODECS = ("fp16", "bf16", "int8")
LOSSY_CODECS = ("int8",)
COMPRESSIONS = ("zstd", "blosc", "none")
TOKEN_ARRAYS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logits", "logsumexp")
AUX_ARRAYS = ("aux_hidden", "aux_hidden_scale")  # token arrays of a store dumped with aux_layers
SEQUENCE_ARRAYS = ("offsets", "sample_ids")
CHUNK_CHECKSUM = "crc32c"  # per-chunk checksum (shard record ``chunk_checksum``; older stores have none)


class StoreError(RuntimeError):
    """A store that is missing, incomplete, corrupt or inconsistent with another."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.zarr"


def shard_index(name: str) -> int | None:
    """Index of a final shard name ``shard-XXXXX.zarr``; None for anything else (temporaries)."""
    if not (name.startswith("shard-") and name.endswith(".zarr")):
        return None
    digits = name[len("shard-") : -len(".zarr")]
    return int(digits) if digits.isdigit() else None


def temp_shard_name(index: int) -> str:
    """A unique hidden name to write shard ``index`` into before the rename."""
    return temp_path(shard_name(index)).name


def array_schema(d: int, k: int, codec: str, num_aux: int = 0) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Array name -> (numpy dtype, trailing shape); the leading dim is N tokens or S(+1).

    ``num_aux``: the number L of auxiliary layers stored (``aux_hidden`` [N, L*d]), 0 for none."""
    assert codec in HIDDEN_CODECS, f"hidden codec {codec!r} not in {HIDDEN_CODECS}"
    hidden_dtype = {"fp16": "float16", "bf16": "uint16", "int8": "int8"}[codec]
    schema = {
        "input_ids": ("int32", ()),
        "loss_mask": ("uint8", ()),
        "hidden": (hidden_dtype, (d,)),
        "topk_ids": ("int32", (k,)),
        "topk_logits": ("float16", (k,)),
        "logsumexp": ("float32", ()),
        "offsets": ("int64", ()),
        "sample_ids": ("str", ()),
    }
    if codec == "int8":
        schema["hidden_scale"] = ("float32", ())
    if num_aux:
        schema["aux_hidden"] = (hidden_dtype, (num_aux * d,))
        if codec == "int8":
            schema["aux_hidden_scale"] = ("float32", (num_aux,))
    return schema


def bytes_per_token_reference(d: int, k: int, num_aux: int = 0) -> int:
    """Uncompressed fp16 bytes per token: hidden 2d + topk 4K+2K + ids 4 + mask 1 (+ lse 4), plus 2Ld
    for L auxiliary layers."""
    return 2 * d * (1 + num_aux) + 6 * k + 5


# --- hidden-state codecs -----------------------------------------------------------------------


def encode_hidden(hidden: torch.Tensor, codec: str, *, name: str = "hidden", parts: int = 1) -> dict[str, np.ndarray]:
    """(N, F) float states -> the stored arrays ``name`` and, for int8, ``name + "_scale"``.

    ``parts``: the row holds that many equal slices (the L layers of ``aux_hidden``), each with its own
    int8 scale (scale (N, parts); (N,) when ``parts`` is 1)."""
    assert hidden.dim() == 2, f"{name} must be (N, F); got {tuple(hidden.shape)}"
    assert hidden.shape[1] % parts == 0, f"{name} width {hidden.shape[1]} is not {parts} equal parts"
    h = hidden.detach().to("cpu")
    if codec == "fp16":
        return {name: h.to(torch.float16).numpy()}  # (N, F) float16
    if codec == "bf16":
        bits = h.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # (N, F) uint16
        return {name: bits}
    if codec == "int8":
        n, width = h.shape
        h = h.float().reshape(n, parts, width // parts)  # (N, P, F/P)
        scale = h.abs().amax(dim=-1).clamp(min=1e-12) / 127.0  # (N, P)
        q = torch.round(h / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, width)  # (N, F)
        scale = scale[:, 0] if parts == 1 else scale  # (N,) | (N, P)
        return {name: q.numpy(), f"{name}_scale": scale.numpy().astype(np.float32)}
    raise ValueError(f"hidden codec {codec!r} not in {HIDDEN_CODECS}")


def decode_hidden(hidden: np.ndarray, codec: str, scale: np.ndarray | None = None) -> torch.Tensor:
    """Stored ``hidden`` (N, F) (+ its int8 scale (N,) or (N, P)) -> float32 (N, F)."""
    if codec not in HIDDEN_CODECS:
        raise ValueError(f"hidden codec {codec!r} not in {HIDDEN_CODECS}")
    values = stored_tensor(hidden, codec)  # (N, F)
    # the scales (N,) | (N, P) copied: a small array, and zarr's may be read-only (torch warns on such a tensor)
    return dequantize_features(values, None if scale is None else torch.from_numpy(np.array(scale, np.float32)))


def stored_tensor(values: np.ndarray, codec: str) -> torch.Tensor:
    """A stored ``hidden``/``aux_hidden`` array as a tensor of its torch dtype, without copying:
    float16 (fp16), bfloat16 (bf16: the uint16 bits viewed) or int8 codes (int8)."""
    values = np.ascontiguousarray(values)
    if codec == "bf16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def array_digest(values: np.ndarray) -> str:
    """sha256 of an array's little-endian C-order bytes (strings: of their JSON list)."""
    if values.dtype.kind in ("U", "T", "O", "S"):
        blob = json.dumps([str(v) for v in values.tolist()]).encode()
    else:
        blob = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes()
    return hashlib.sha256(blob).hexdigest()
