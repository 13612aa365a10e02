"""The per-token feature format a draft trains on, and its configuration.

What the target's prefill gives per token — its last hidden state (the tensor its lm_head consumes), the
top-K logits with the full row's log-sum-exp, and with ``aux_layers`` the states of auxiliary target layers
(the EAGLE-3 features: "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", §3) — is described once here: ``FeaturesConfig`` says what is stored and how it is
computed, ``features_hash`` which of its fields decide the stored arrays, and ``aux_layers_of`` resolves the
auxiliary layers for a target. The dump (Ray Data, ``pipelines/dump.py``), online features
(``specdraft.online``) and the quickstart compute them with these settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.config import config_hash, to_dict
from specdraft.placement import ATTN_IMPLEMENTATIONS, spread_gpus
from specdraft.target import resolve_aux_layers


@dataclass(frozen=True, kw_only=True, slots=True)
class FeaturesConfig:
    """What the dump stores and how it runs."""

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
    num_actors: int = 1
    # GPUs per actor (GPU clusters only): the Ray request AND the target's spread — a fraction shares
    # one GPU, a whole N > 1 splits the target's layers over the actor's N GPUs (device_map)
    gpus_per_actor: float = 1.0
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"  # flash: CUDA + flash-attn only
    cpus_per_actor: float = 1.0
    torch_threads: int | None = None  # CPU threads per actor (default: cpus_per_actor)
    chunk_tokens: int = 1024  # Zarr chunk length along the token axis
    compression: Literal["zstd", "blosc", "none"] = "zstd"
    compression_level: int = 3
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        assert self.max_length >= 1 and self.topk >= 1 and self.samples_per_shard >= 1, "sizes must be >= 1"
        assert self.batch_tokens >= 1 and self.max_batch_size >= 1 and self.num_actors >= 1, "sizes must be >= 1"
        assert self.attn_implementation in ATTN_IMPLEMENTATIONS, f"unknown attn_implementation {self.attn_implementation!r}"
        spread_gpus(self.gpus_per_actor)  # a fraction or a whole number


# not in features_hash (placement and kernel: the same features up to rounding)
RUNTIME_FIELDS = ("num_actors", "gpus_per_actor", "cpus_per_actor", "torch_threads", "attn_implementation")


def features_hash(cfg: FeaturesConfig, aux_layers: list[int] | None = None) -> str:
    """Hash of the fields that decide what is stored (resume refuses shards of another hash).

    ``aux_layers``: the resolved layer ids (``"eagle3"`` and its explicit list store the same arrays);
    without auxiliary layers the hash is that of a config predating the field."""
    fields = {k: v for k, v in to_dict(cfg).items() if k not in RUNTIME_FIELDS and k != "aux_layers"}
    if aux_layers:
        fields["aux_layers"] = list(aux_layers)
    return config_hash(fields)


def aux_layers_of(cfg: FeaturesConfig, target_config) -> list[int]:
    """``cfg.aux_layers`` resolved for this target (HF ``output_hidden_states`` indices)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return resolve_aux_layers(cfg.aux_layers, int(text.num_hidden_layers))
