"""The serving engine measurement's settings (``eval.engine`` in a run config; docs/evaluation.md):
which engine serves the exported draft beside our decoder, and how it is started.

Settings only (the measurement itself is ``specdraft.evaluation.engine``): this module imports no engine,
no torch. The engine's context ``max_model_len`` defaults to the target's own (``max_position_embeddings``,
resolved by ``specdraft.preflight.engine_model_len``); a value above it is refused before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specdraft.config import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    name: Literal["none", "vllm"] = "none"  # measure served acceptance too: vllm (the draft exported, then served)
    speculative_tokens: int = 3  # K: draft tokens per step (vLLM drafts chains)
    dtype: str = "auto"  # auto: float32 on CPU, the target's dtype on GPU | float32 | bfloat16 | float16
    # the engine's context (prompt + answer); None: the target's max_position_embeddings (a larger value is refused)
    max_model_len: int | None = None
    tensor_parallel_size: int = 1  # GPUs the engine spreads the target over
    gpu_memory_utilization: float = 0.85  # GPU memory vLLM may take (GPU only)
    cpu_kvcache_gib: int = 1  # KV cache on a CPU engine (VLLM_CPU_KVCACHE_SPACE)
    enforce_eager: bool | None = None  # no CUDA graphs / compilation; None: on CPU only
    max_gap: float = 0.03  # |engine - ours| / ours above this: a warning in the run summary
    timeout_s: float = 3600.0  # the engine process is stopped after this long

    def __post_init__(self) -> None:
        if self.name not in ("none", "vllm"):
            raise ConfigError(f"name: must be 'none' or 'vllm', got {self.name!r}")
        if self.speculative_tokens < 1:
            raise ConfigError(f"speculative_tokens={self.speculative_tokens}: must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len}: must be >= 2 (or null: the target's)")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.cpu_kvcache_gib < 1:
            raise ConfigError(f"cpu_kvcache_gib={self.cpu_kvcache_gib}: must be >= 1")
        if self.max_gap < 0:
            raise ConfigError(f"max_gap={self.max_gap}: must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.name != "none"
