"""The settings of the Ray side and of the pipelines' stages, importing no torch, Ray or MLflow (``--help`` reads
them directly): the Ray knobs of training (workers, GPUs, checkpoints, failures: ``ClusterTrainConfig``) and of the
dump (actors and their resources: ``DumpConfig``), regeneration and its ingest, evaluation's replicas, MLflow
tracking, and the ``specdraft run`` config (``RunConfig``) made of them. The core settings they extend are
``specdraft/configs/``.

``ClusterTrainConfig`` and ``DumpConfig`` extend the core ``TrainConfig`` and ``FeaturesConfig`` with their Ray fields,
so a config's keys (``train.scaling.num_workers``, ``features.num_actors``) and its stage hashes are unchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from specdraft.config import ConfigError
from specdraft.configs.evaluation import EvalSettings
from specdraft.configs.export import ExportConfig
from specdraft.configs.features import FeaturesConfig
from specdraft.configs.fresh import GateSettings, HandoffSettings, MonitorSettings, RetrainSettings, TrafficSettings
from specdraft.configs.toy import ToyTargetConfig
from specdraft.configs.train import TrainConfig
from specdraft.configs.devices import check_attn_implementation, spread_gpus


def _at_least_one(cfg: Any, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)}: must be >= 1")


# --- training on Ray Train ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalingSection:
    # 0: Ray Train's local mode — the training loop runs in this process, without worker actors (a
    # laptop, a debugger, a quick check); its checkpoints are not kept for a rerun, which starts over
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 1.0
    strategy: Literal["ddp", "fsdp"] = "ddp"  # the draft over the workers: ddp replicates it, fsdp shards it

    def cpu_threads(self) -> int | None:
        """Torch threads of a CPU worker: the CPUs it holds (at least 1). None — torch's own count — on GPUs and in
        local mode (``num_workers=0``: the driver's process)."""
        return None if self.use_gpu or self.num_workers == 0 else max(1, int(self.cpus_per_worker))


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterTrainConfig(TrainConfig):
    """The ``train`` section as Ray Train runs it: the core settings and the Ray knobs."""

    checkpoint_every: int = 500  # optimizer steps between checkpoints (epoch ends always checkpoint)
    keep_checkpoints: int = 2
    max_failures: int = 0
    scaling: ScalingSection = field(default_factory=ScalingSection)

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)  # (a slots dataclass: no zero-argument super())
        _at_least_one(self, "keep_checkpoints")
        for name in ("checkpoint_every", "max_failures"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.scaling.num_workers < 0:
            raise ConfigError(f"scaling.num_workers={self.scaling.num_workers}: 0 (in this process) or more workers")


def on_cluster(cfg: TrainConfig) -> ClusterTrainConfig:
    """``cfg`` as Ray Train runs it: a core ``TrainConfig`` gets the Ray knobs' defaults."""
    if isinstance(cfg, ClusterTrainConfig):
        return cfg
    return ClusterTrainConfig(**{f.name: getattr(cfg, f.name) for f in fields(TrainConfig)})


# --- the dump on Ray Data ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class DumpConfig(FeaturesConfig):
    """What the dump stores (``FeaturesConfig``) and the Ray Data actors it runs on."""

    num_actors: int = 1
    # GPUs per actor (GPU clusters only): the Ray request AND the target's spread — a fraction shares
    # one GPU, a whole N > 1 splits the target's layers over the actor's N GPUs (device_map)
    gpus_per_actor: float = 1.0
    cpus_per_actor: float = 1.0
    torch_threads: int | None = None  # CPU threads per actor (default: cpus_per_actor)

    def __post_init__(self) -> None:
        FeaturesConfig.__post_init__(self)
        _at_least_one(self, "num_actors")
        spread_gpus(self.gpus_per_actor, "gpus_per_actor")  # a fraction or a whole number


def for_dump(cfg: FeaturesConfig) -> DumpConfig:
    """``cfg`` as the dump runs it: a core ``FeaturesConfig`` gets the actors' defaults."""
    if isinstance(cfg, DumpConfig):
        return cfg
    return DumpConfig(**{f.name: getattr(cfg, f.name) for f in fields(FeaturesConfig)})


def core_features(cfg: FeaturesConfig) -> FeaturesConfig:
    """The features of ``cfg`` without the dump's actors (online training computes them in its workers)."""
    return FeaturesConfig(**{f.name: getattr(cfg, f.name) for f in fields(FeaturesConfig)})


# --- regeneration and its ingest --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class IngestConfig:
    """Limits and dedup policy of the ingest stage."""

    max_chars: int = 100_000  # total characters of a conversation's messages
    max_turns: int = 32  # user turns per conversation
    dedup: Literal["messages", "prompts", "none"] = "messages"  # prompts: system + user turns only
    excerpt_chars: int = 300  # raw excerpt kept per reject


REGENERATE_MODES = ("target", "shipped", "mixed")


@dataclass(frozen=True, kw_only=True, slots=True)
class RegenerateConfig:
    """How the target regenerates the answers (``mode``: whether it does; ``pipelines/shipped.py``)."""

    # target: the target answers every prompt (its own text: on-policy); shipped: the conversations' own answers
    # are kept as they ship (ShareGPT's, another model's logged responses), nothing is generated and no target
    # loads — the labels are still the target's distribution, computed by the dump's prefill; mixed: the target
    # regenerates a `share` of the conversations (chosen by seed and prompt digest), the rest ship as they are
    mode: Literal["target", "shipped", "mixed"] = "target"
    share: float | None = None  # mixed only: the share of conversations the target regenerates, 0 < share < 1
    backend: Literal["hf", "vllm"] = "hf"
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 256  # per assistant turn
    seed: int = 0
    max_model_len: int | None = None  # prompt + new tokens; None: the target's max_position_embeddings
    batch_size: int = 16  # conversations per batch (= per generate call and per output part)
    concurrency: int = 1  # model replicas (Ray actors)
    # GPUs per hf replica (GPU clusters only): the Ray request AND the target's spread — a fraction
    # shares one GPU, a whole N > 1 splits the layers over the replica's N GPUs (device_map).
    # vllm: set vllm_engine_kwargs.tensor_parallel_size instead
    num_gpus: float = 1.0
    num_cpus: float = 1.0  # per replica; hf on CPU: its torch threads
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"  # hf; flash: CUDA + flash-attn
    limit: int | None = None  # only the first N ingested conversations
    trust_remote_code: bool = False
    ray_address: str | None = None  # used only when Ray is not initialized yet
    # vllm.LLM's engine arguments on top of max_model_len / dtype (e.g. tensor_parallel_size: the replica's GPUs;
    # on CPU kv_cache_memory_bytes, else vLLM reserves a share of the machine's memory, and enforce_eager)
    vllm_engine_kwargs: dict[str, Any] = field(default_factory=dict)
    vllm_chunk_size: int = 4096  # conversations per vllm replica batch (= per part) at most; fewer if replicas would idle
    # environment variables a vllm replica sets before its engine starts (vLLM's own, VLLM_*): on CPU the cores it
    # computes on (VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1) and those it keeps for its scheduler
    # (VLLM_CPU_NUM_OF_RESERVED_CPU; by default one of the node's cores: docs/commands.md "Regeneration backends")
    vllm_env: dict[str, str | int] = field(default_factory=dict)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    allow_empty: bool = False  # prompts that ingest to no conversation: an error (exit 2) unless true

    def __post_init__(self) -> None:
        if self.mode == "mixed" and (self.share is None or not 0 < self.share < 1):
            raise ConfigError(f"share={self.share}: mode=mixed regenerates this share of the conversations, a number "
                              "between 0 and 1 (exclusive; mode=target regenerates all, mode=shipped none)")
        if self.mode != "mixed" and self.share is not None:
            raise ConfigError(f"share={self.share}: only mode=mixed regenerates a share (mode={self.mode}); set "
                              "mode=mixed or drop share")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p}: must be in (0, 1]")
        _at_least_one(self, "max_new_tokens", "batch_size", "concurrency")
        for key in self.vllm_env:
            if not key.startswith("VLLM_"):
                raise ConfigError(f"vllm_env.{key}: only vLLM's own environment variables (VLLM_*, e.g. "
                                  "VLLM_CPU_OMP_THREADS_BIND) are set for its engine")
        check_attn_implementation(self.attn_implementation)
        spread_gpus(self.num_gpus, "num_gpus")  # a fraction or a whole number


# --- evaluation replicas and tracking ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class RayEvalConfig:
    """How questions are spread over model replicas."""

    replicas: int | None = None  # None: one per settings.gpus GPUs on a GPU cluster, else one per num_cpus CPUs
    num_cpus: float = 1.0  # per replica; on CPU also its torch threads (GPUs per replica: EvalSettings.gpus)
    address: str | None = None  # used only when Ray is not initialized yet (None: local / RAY_ADDRESS)


DEFAULT_EXPERIMENT = "specdraft"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a SQLite file under the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackingConfig:
    enabled: bool = True
    uri: str | None = None  # None: MLFLOW_TRACKING_URI or sqlite:///./mlflow.db
    experiment: str = DEFAULT_EXPERIMENT
    artifact_location: str | None = None  # where a newly created experiment stores artifacts
    # the longest one call to a tracking server may wait, its retry included (``pipelines.tracking.bound_requests``;
    # MLflow's own: 120 s a try, 8 tries with backoff — over 10 minutes on a server that accepts and never answers)
    timeout_s: int = 30

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_s, int) or isinstance(self.timeout_s, bool) or self.timeout_s < 2:
            raise ConfigError(f"tracking.timeout_s={self.timeout_s!r}: whole seconds, at least 2 (two tries of "
                              "half of it each)")

    def resolved_uri(self) -> str:
        return self.uri or default_tracking_uri()


# --- specdraft run ------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetSection:
    path: str = ""  # HF model directory; empty = build the toy target from ``toy``
    toy: ToyTargetConfig = field(default_factory=ToyTargetConfig)
    # copy the toy target shipped with specdraft when ``toy`` is its (the default) config; false:
    # train it here (minutes of one core)
    prebuilt: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSection:
    prompts: list[str] = field(default_factory=list)  # files, directories or glob patterns
    # replaced by regenerate.mode (shipped: the prompts' own answers); false is refused, naming it
    regenerate: bool = field(default=True, metadata={"hidden": True})
    traffic: TrafficSettings = field(default_factory=TrafficSettings)  # dated request logs (specdraft/freshness/traffic.py)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalSection:
    questions: list[str] = field(default_factory=list)  # MT-Bench-format files
    settings: EvalSettings = field(default_factory=EvalSettings)
    use_ray: bool = False
    replicas: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class RegisterSection:
    enabled: bool = True
    model_name: str = "specdraft-draft"
    alias: str = "champion"
    export: bool = True  # export the draft in the serving formats that fit it (specdraft.export), logged beside it
    serving: ExportConfig = field(default_factory=ExportConfig)  # dtype, K, verifier of the exports


@dataclass(frozen=True, kw_only=True, slots=True)
class RaySection:
    address: str | None = None  # None: a local Ray; "auto" / "ray://host:10001": a cluster
    num_cpus: int | None = None  # local Ray only


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultSection:
    """Failure drills: make a stage fail on purpose to check that a rerun recovers."""

    # raise once at this optimizer step (a test hook: hidden from --help)
    train_fail_at_step: int | None = field(default=None, metadata={"hidden": True})


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    name: str = "specdraft"
    workdir: str = "runs"
    # where the dump writes the run's feature stores, <store_root>/<key>: a directory or an object-store URL
    # (s3://bucket/prefix: every node writes and reads the same stores); "" = <workdir>/features (docs/cluster.md)
    store_root: str = ""
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: DumpConfig = field(default_factory=DumpConfig)
    train: ClusterTrainConfig = field(default_factory=ClusterTrainConfig)
    eval: EvalSection = field(default_factory=EvalSection)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    register: RegisterSection = field(default_factory=RegisterSection)
    ray: RaySection = field(default_factory=RaySection)
    monitor: MonitorSettings = field(default_factory=MonitorSettings)  # the served draft's acceptance (vLLM /metrics)
    retrain: RetrainSettings = field(default_factory=RetrainSettings)  # train every night, or when it pays
    gate: GateSettings = field(default_factory=GateSettings)  # window win AND no regression (specdraft/freshness/gate.py)
    handoff: HandoffSettings = field(default_factory=HandoffSettings)  # the promoted draft at exports/current
    retries: int = 2  # per task, with backoff (10 s, 60 s, 180 s)
    fault: FaultSection = field(default_factory=FaultSection)

    def __post_init__(self) -> None:
        """Refuse the ``train`` keys the train stage sets itself (they would be silently replaced), and values no
        stage can run with (each a ``ConfigError`` naming its key, raised before any stage starts)."""
        if self.retries < 0:
            raise ConfigError(f"retries={self.retries}: must be >= 0")
        if not self.data.regenerate:
            raise ConfigError("data.regenerate=false: replaced by regenerate.mode=shipped (train on the prompts' own "
                              "answers; a prompt without one is a counted reject) — set that instead")
        if self.eval.replicas is not None and self.eval.replicas < 1:
            raise ConfigError(f"eval.replicas={self.eval.replicas}: must be >= 1 (or null)")
        if self.ray.num_cpus is not None and self.ray.num_cpus < 1:
            raise ConfigError(f"ray.num_cpus={self.ray.num_cpus}: must be >= 1 (or null: every core)")
        default = ClusterTrainConfig()
        online = [f.name for f in fields(self.train.online)
                  if getattr(self.train.online, f.name) != getattr(default.online, f.name)]
        if online:
            raise ConfigError(
                f"train.online: specdraft run computes features with its features section, for the dump and for "
                f"online training alike; set {', '.join(f'features.{k}' for k in online)} instead of "
                f"{', '.join(f'train.online.{k}' for k in online)}")
        if self.train.conversations:
            raise ConfigError("train.conversations: specdraft run trains on the conversations it regenerates from "
                              "data.prompts; set data.prompts instead")
