"""What a feature store holds per token and how a prefill computes it (``specdraft/features.py``): the EAGLE
hidden state, the HASS top-K logits and, with ``aux_layers``, the EAGLE-3 auxiliary target layers
("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test", §3).
The dump's Ray actors are set in ``pipelines/configs.py`` (``DumpConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.config import ConfigError
from specdraft.configs.devices import check_attn_implementation

EAGLE3 = "eagle3"  # aux_layers: the EAGLE-3 default triple


@dataclass(frozen=True, kw_only=True, slots=True)
class FeaturesConfig:
    """What the dump stores and how a prefill computes it."""

    max_length: int = 2048  # tokens per conversation
    overlong: Literal["truncate", "reject"] = "truncate"
    topk: int = 10
    hidden_codec: Literal["fp16", "bf16", "int8"] = "fp16"  # int8: per-token absmax scale, lossy
    # auxiliary target layers stored as aux_hidden [N, L*d] (EAGLE-3 features), same codec as hidden:
    # None (none), "eagle3" (states entering layers 2, N/2, N-3) or HF hidden_states indices
    aux_layers: Literal["eagle3"] | list[int] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # inference; auto: bf16 on GPU, fp32 on CPU
    samples_per_shard: int = 64  # a shard is one Ray row: ~ samples * tokens * (2d + 6K + 5) bytes
    batch_tokens: int = 8192  # padded tokens per prefill batch
    max_batch_size: int = 64
    logits_chunk: int = 2048  # tokens per float32 top-K / logsumexp chunk
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"  # flash: CUDA + flash-attn only
    chunk_tokens: int = 1024  # Zarr chunk length along the token axis (fewer rows in a chunk over 1 MiB: writer.CHUNK_BYTES)
    compression: Literal["zstd", "blosc", "none"] = "zstd"
    compression_level: int = 3
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        for name in ("max_length", "topk", "samples_per_shard", "batch_tokens", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 1")
        check_attn_implementation(self.attn_implementation)
