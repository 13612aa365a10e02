"""Evaluation settings: decoding, the prompt-lookup floor, the questions' placement and baselines, and the serving
engine's measurement (τ as in "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §5, on
MT-Bench-format questions). The evaluation itself is ``specdraft/evaluation/``; the engine's ``evaluation/engine.py``.
The engine's context ``max_model_len`` defaults to the target's own (``max_position_embeddings``,
``specdraft.preflight.engine_model_len``); a larger value is refused in pre-flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdraft.config import ConfigError
from specdraft.configs.decode import DecodeConfig, PromptLookupConfig

VANILLA_DRIFT_WARN = 0.10  # engine.vanilla_drift_warn's default
CPU_KVCACHE_GIB = 1  # vLLM's KV cache on a CPU host, GiB: the engine measurement's and the printed serve commands'


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    name: Literal["none", "vllm"] = "none"  # measure served acceptance too: vllm (the draft exported, then served)
    speculative_tokens: int = 3  # K: draft tokens per step (vLLM drafts chains); our decoder is compared at this K
    # the K the engine is timed at, with the draft and with vLLM's ngram (``ngram``): each K one engine start and
    # one timed pass over the eval prompts per drafter; the fastest is the serve commands' K and the gate's
    # (docs/evaluation.md, "K chosen by the engine")
    sweep_k: tuple[int, ...] = (1, 2, 3, 4, 5)
    ngram: bool = True  # vLLM's own ngram prompt lookup timed at each K too: the gate's floor in the engine
    dtype: str = "auto"  # auto: float32 on CPU, the target's dtype on GPU | float32 | bfloat16 | float16
    max_model_len: int | None = None  # the engine's context (prompt + answer); None: the target's positions
    tensor_parallel_size: int = 1  # GPUs the engine spreads the target over
    gpu_memory_utilization: float = 0.85  # GPU memory vLLM may take (GPU only)
    cpu_kvcache_gib: int = CPU_KVCACHE_GIB  # KV cache on a CPU engine (vLLM's kv_cache_memory_bytes, in GiB)
    enforce_eager: bool | None = None  # no CUDA graphs / compilation; None: on CPU only
    max_gap: float = 0.03  # |engine - ours| / ours above this: a warning in the run summary
    # the target alone is timed before the first drafter and, with 2, again after the last, on the same prompts:
    # every engine speedup divides by both passes' tokens/s combined (docs/evaluation.md, "Every speedup is timed
    # in one run"); 1: once, before (quick runs, tests whose time matters)
    vanilla_passes: int = 2
    vanilla_drift_warn: float = VANILLA_DRIFT_WARN  # |second pass's tokens/s / first's - 1| above this: a warning
    timeout_s: float = 3600.0  # the engine process is stopped after this long

    def __post_init__(self) -> None:
        if self.name not in ("none", "vllm"):
            raise ConfigError(f"name: must be 'none' or 'vllm', got {self.name!r}")
        if self.speculative_tokens < 1:
            raise ConfigError(f"speculative_tokens={self.speculative_tokens}: must be >= 1")
        if not self.sweep_k or any(k < 1 for k in self.sweep_k) or len(set(self.sweep_k)) != len(self.sweep_k):
            raise ConfigError(f"sweep_k={list(self.sweep_k)}: distinct K >= 1, at least one")
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
        if self.vanilla_passes not in (1, 2):
            raise ConfigError(f"vanilla_passes={self.vanilla_passes}: must be 1 or 2")
        if self.vanilla_drift_warn < 0:
            raise ConfigError(f"vanilla_drift_warn={self.vanilla_drift_warn}: must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @property
    def measured_k(self) -> tuple[int, ...]:
        """Every K the engine is timed at: ``sweep_k`` and ``speculative_tokens`` (our decoder's), ascending."""
        return tuple(sorted({*self.sweep_k, self.speculative_tokens}))


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSettings:
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    pld: PromptLookupConfig = field(default_factory=PromptLookupConfig)  # the prompt-lookup floor
    max_questions: int | None = None  # per question file
    seed: int = 0
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    gpus: int = 1  # GPUs per model copy: the target is spread over them (device_map); a Ray replica requests as many
    # vanilla and speculative decoding use the same kernel; tree verification passes a 4D mask,
    # which flash-attention cannot take, so eval targets load with sdpa (or eager)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    system_prompt: str | None = None
    warmup: bool = True  # one short untimed generation before the first timed one
    # processes the questions are spread over: None = one per CPU core (CPU) or per ``gpus`` GPUs (CUDA);
    # 1 = in this process. Records are the same whatever the split (timings aside)
    workers: int | None = None
    # where vanilla's tokens and the floor's counts are kept (never times: every evaluation times them itself) and
    # compared with the next evaluation's: "auto" = beside the report (``<report dir>/baselines``; the flow's:
    # ``<workdir>/eval/baselines``; no report: none), "off" = kept nowhere, else a directory
    baselines: str = "auto"
    engine: EngineSettings = field(default_factory=EngineSettings)  # the serving engine's measurement (vLLM)
    allow_empty: bool = False  # question files holding no question: an error (exit 2) unless true

    def __post_init__(self) -> None:
        if self.max_questions is not None and self.max_questions < 1:
            raise ConfigError(f"max_questions={self.max_questions}: must be >= 1 (or null: every question)")
        if self.gpus < 1:
            raise ConfigError(f"gpus={self.gpus}: must be >= 1")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers={self.workers}: must be >= 1 (or null: one per core / GPU group)")
        if not self.baselines:
            raise ConfigError("baselines: 'auto', 'off' or a directory")
