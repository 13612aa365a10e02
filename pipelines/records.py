"""The records the flow's stages return and pass on (docs/operations.md "The nightly deployment").

``to_dict()`` is the dict the flow, MLflow and a stage's DONE file see (keys in field order); ``from_dict``
reads one back (a DONE file; unknown keys refused). They cross Prefect task boundaries, so they hold plain
values only (paths as strings): no tensors, nothing that does not pickle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft import config
from specdraft.freshness.record import TrafficRecord


class Record:
    """``to_dict``/``from_dict`` of a frozen record dataclass."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        return config.from_dict(cls, data)


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptFile(Record):
    path: str  # resolved
    digest: str  # file_digest: a grown or edited file is a new input
    reuse: bool = False  # conversations with the target's logged answers (data.traffic): ingested, not regenerated



@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared(Record):
    """``prepare``: the resolved target and the prompt files, each regenerated on its own."""

    target: str  # the target's model directory, resolved
    target_id: str  # specdraft.targets.identity.target_id: part of every downstream key
    prompts: list[PromptFile]
    wall_s: float
    traffic: TrafficRecord | None = None  # data.traffic's window (pipelines.stages.prepare_traffic); None when off



@dataclass(frozen=True, kw_only=True, slots=True)
class Regenerated(Record):
    """``regenerate``: one prompt file's conversations (the target's own answers, or the file's)."""

    key: str
    prompt: str  # the prompt file
    conversations: str  # directory of Parquet conversation files
    summary: dict[str, Any]  # regenerate's (or ingest's) counts
    wall_s: float
    skipped: bool = False  # finished by an earlier run (read from its DONE file)



@dataclass(frozen=True, kw_only=True, slots=True)
class Dumped(Record):
    """``features``: one regenerated file's feature store."""

    key: str
    store: str  # the feature store directory
    summary: dict[str, Any]  # the dump's counts
    wall_s: float
    skipped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Trained(Record):
    """``train``: the draft trained on every store (or, online, every regenerated file)."""

    key: str
    draft: str  # the draft directory (config.json + model.safetensors)
    metrics: dict[str, Any]  # the final held-out metrics
    metrics_file: str  # metrics.jsonl: params, then every logged step
    wall_s: float
    nodes: list[dict[str, Any]] = field(default_factory=list)  # the Ray node of each rank (pipelines.nodes.by_node)
    skipped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Evaluated(Record):
    """``eval``: tau per eval set and the prompt-lookup floor measured beside it (docs/evaluation.md)."""

    key: str
    eval_key: str  # the eval sets + settings: tau is only compared between equal eval keys
    report: str  # report.json
    tau: dict[str, float]  # eval set -> mean accepted length (sets with a tau only)
    mean_tau: float | None  # None: no set gave a tau
    tau_pld: dict[str, float] = field(default_factory=dict)  # the floor per set; empty when not measured
    tau_over_pld: dict[str, float] = field(default_factory=dict)
    mean_tau_pld: float | None = None
    # eval set -> the serving engine's acceptance length at the same K (empty: no engine measured it); the run
    # summary shows it beside tau and warns on a gap
    engine_tau: dict[str, float] = field(default_factory=dict)
    mean_engine_tau: float | None = None  # over the same sets as tau; the champion gate's measure when set
    # eval set -> the engine's tokens/s with the draft over its own without it (empty: not measured); the summary and
    # the report show it beside engine_tau
    engine_speedup: dict[str, float] = field(default_factory=dict)
    engine_warnings: list[str] = field(default_factory=list)  # engine vs our decoder gaps above engine.max_gap
    # "draft" / "ngram" -> {"k": the fastest K in the engine, "speedup": there} (the report's engine.sweep;
    # specdraft.freshness.engine_gate.best_of); empty: no engine measured it
    engine_best: dict[str, dict[str, Any]] = field(default_factory=dict)
    lossless_mismatches: int = 0
    wall_s: float = 0.0
    nodes: list[dict[str, Any]] = field(default_factory=list)  # questions per Ray node (eval.use_ray; else empty)
    skipped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Exported(Record):
    """The draft's serving exports (part of ``register``); none, and why (``note``), when no format fits or
    exports are disabled (then ``key`` is empty: nothing was written)."""

    key: str = ""
    arch: str
    exports: dict[str, str]  # format -> directory
    note: str
    wall_s: float
    skipped: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Registered(Record):
    """``register``: the registry's decision (``pipelines.registry.register_draft``: fields ``model_name`` to
    ``reason``), the exports logged beside the version and how to serve the champion. Not registered
    (``registered`` false, tracking or the stage disabled): the decision fields stay empty and ``reason``
    says why."""

    registered: bool = True
    model_name: str = ""
    version: int | None = None
    run_id: str | None = None
    mean_tau: float | None = None
    recipe: str = ""  # the recipe that trained this run's draft (train.recipe)
    champion_version: int | None = None
    champion_mean_tau: float | None = None  # the champion's value of the gate's measure (``compared_by``)
    compared_by: str = "tau"  # the gate's measure: "tau" (our decoder) or "engine acceptance length" (vLLM)
    mean_engine_tau: float | None = None  # the serving engine's mean acceptance length (None: not measured)
    mean_tau_pld: float | None = None
    tau_over_pld: float | None = None  # None: no floor measured, or the draft was registered by an earlier run
    above_floor: bool | None = None
    promoted: bool = False
    alias: str = ""
    reason: str = ""
    exports: dict[str, str] = field(default_factory=dict)
    export_note: str = ""
    serving_champion: int | None = None  # the version holding the alias now
    champion_recipe: str = ""  # the recipe that trained it (its specdraft.recipe tag; "": registered without one)
    serve: dict[str, str] = field(default_factory=dict)  # engine -> command serving the champion
    gate: dict[str, Any] = field(default_factory=dict)  # specdraft.freshness.gate.GateDecision.to_dict() (gate.enabled)
    engine_gate: dict[str, Any] | None = None  # specdraft.freshness.engine_gate.EngineVerdict.to_dict(); None: no engine
    engine_best_k: int | None = None  # the draft's fastest K in the engine: the serve commands' unless set
    handoff: str = ""  # <exports>/current when this version was handed off to serving now
    restart: str = ""  # what a server needs to do to serve what was handed off
    served_version: int | None = None  # the version <exports>/current serves after this run (None: none, or off)
    served_note: str = ""  # why the served draft is not the champion ("" when it is): the summary says it
    wall_s: float = 0.0
