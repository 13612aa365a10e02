"""The evaluation's settings (docs/evaluation.md; τ as in "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees", §5): decode settings, the prompt-lookup floor,
placement, workers, the baseline cache and the serving engine's measurement.

Settings only: the evaluation itself is the package ``specdraft.evaluation`` (questions, per-question
records, baselines, replicas, report, engine measurement). This module stays here until the settings move
to ``specdraft/configs/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdraft.config import ConfigError
from specdraft.decoding.prompt_lookup import PromptLookupConfig
from specdraft.decoding.speculative import DecodeConfig
from specdraft.serving.engine import EngineSettings


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
    # vanilla / prompt-lookup cache directory: "auto" = beside the report (``<report dir>/baselines``; the
    # flow's: ``<workdir>/eval/baselines``; no report: none), "off" = decode them every time, else a directory
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
