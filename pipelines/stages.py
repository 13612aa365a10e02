"""The stages of ``regenerate-and-train`` as plain functions over a run config (docs/commands.md,
``specdraft run``; docs/operations.md "The nightly deployment").

Each stage writes under ``<workdir>/<stage>/<key>/`` where ``key`` hashes the stage's
inputs (its config section, upstream output keys, and the code version where it
matters), and returns a small record (paths, keys, metrics): a frozen dataclass whose
``to_dict()`` is what the stage's ``DONE`` file (less ``skipped``), MLflow and the flow's
summary see, and whose ``from_dict`` reads a ``DONE`` file back. A finished stage is
recognised by its ``DONE`` file (written last) and skipped; an unfinished one is resumed
by the stage itself (regeneration skips written conversations, the dump keeps complete
shards, training restarts from its latest checkpoint). Prompts are handled per file, so
a nightly run on a grown prompt directory only regenerates and dumps the new files, and
a changed training config reuses the existing feature stores.

Features are configured in one place, the run's ``features`` section: the dump stores them with
it and online training (``train.features: online``) computes them with it, so switching modes
never changes the features. ``train.online`` and ``train.conversations`` (``specdraft train``'s
online settings) are set by the train stage; a run config that sets them is refused, naming
the key to set instead.
"""

from __future__ import annotations

import glob
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipelines.cluster import connect_ray
from pipelines.dump import dump_features
from pipelines.configs import ClusterTrainConfig, RunConfig, core_features
from pipelines.regenerate import regenerate
from pipelines.shipped import mode_settings
from pipelines.conversations import read_conversations
from pipelines.records import Dumped, Evaluated, Exported, Prepared, PromptFile, Regenerated, Trained
from pipelines.train import run_training
from specdraft import __version__ as CODE_VERSION
from specdraft import files, jsonl
from specdraft.config import ConfigError, config_hash, to_dict
from specdraft.configs.features import FeaturesConfig
from specdraft.freshness.engine_gate import best_of
from specdraft.plan import aux_layers_setting
from specdraft.export import FORMATS, ExportError, export_draft, formats_for, variant
from specdraft.models import read_draft_config
from specdraft.packaged import resolve_prompt_inputs
from specdraft.store import location
from specdraft.freshness.record import RegressionCounts, TrafficFiles, TrafficRecord
from specdraft.targets import Target
from specdraft.targets.identity import target_id
from specdraft.toy.build import build_toy_target

DONE = "DONE"


def stage_key(*parts: Any) -> str:
    return config_hash([to_dict(p) for p in parts])


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def expand_prompts(patterns: list[str]) -> list[Path]:
    """Files named by paths, directories (recursively), glob patterns and prompt-set names (``sharegpt``:
    ``specdraft.packaged``), sorted and de-duplicated."""
    files: set[Path] = set()
    for pattern in resolve_prompt_inputs(list(patterns)):
        path = Path(pattern)
        if path.is_dir():
            files.update(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif any(ch in pattern for ch in "*?["):
            files.update(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        elif path.is_file():
            files.add(path)
        else:
            raise FileNotFoundError(f"prompt input {pattern!r} is not a file, directory or matching glob")
    if not files:
        raise FileNotFoundError(f"no prompt files found in {patterns}")
    return sorted(p.resolve() for p in files)


def _finished(directory: Path) -> dict[str, Any] | None:
    done = directory / DONE
    return json.loads(done.read_text()) if done.is_file() else None


def _finish(directory: Path, record: dict[str, Any]) -> dict[str, Any]:
    files.write_text(directory / DONE, json.dumps(record, indent=2, default=str))
    return record


def ensure_ray(cfg: RunConfig) -> None:
    connect_ray(cfg.ray.address, cfg.ray.num_cpus)


def prepare(cfg: RunConfig) -> Prepared:
    """Resolve the target (building the toy one if asked) and the prompt files."""
    started = time.perf_counter()
    if cfg.target.path:
        target = Target(cfg.target.path)  # checked: a directory holding a config.json
    else:
        target = Target(build_toy_target(Path(cfg.workdir) / "targets" / f"toy-{config_hash(cfg.target.toy)}",
                                         cfg.target.toy, progress=False, prebuilt=cfg.target.prebuilt))
    prompts = ([PromptFile(path=str(p), digest=file_digest(p)) for p in expand_prompts(cfg.data.prompts)]
               if cfg.data.prompts else [])
    traffic = None
    if cfg.data.traffic.path:
        traffic = prepare_traffic(cfg)
        prompts += [PromptFile(path=path, digest=file_digest(path), reuse=reuse)
                    for path, reuse in ((traffic.files.prompts, False), (traffic.files.reused, True)) if path]
    if not prompts:
        raise ConfigError("data.prompts / data.traffic.path: no prompt to train on (the traffic window is empty)")
    return Prepared(target=str(target.path), target_id=target_id(target), prompts=prompts,
                    wall_s=time.perf_counter() - started, traffic=traffic)


def prepare_traffic(cfg: RunConfig) -> TrafficRecord:
    """Read ``data.traffic``'s window (``specdraft.freshness.traffic``) and write its files under
    ``<workdir>/traffic/<key>/`` (key: the settings and the window's content); returns its record: days, counts,
    warnings and the files (``prompts``: to regenerate; ``reused``: the served model's logged answers;
    ``held_out``). The held-out slice is kept under ``held_out_home`` (once per window end); with ``gate.enabled``
    the earlier windows' slices (``specdraft.freshness.traffic.regression_questions``) are ``regression.jsonl`` and
    their counts ``regression`` (questions, windows, over_cap)."""
    from specdraft.freshness.traffic import keep_held_out, read_window, regression_questions, write_window

    window = read_window(cfg.data.traffic, keep_answers=cfg.regenerate.mode != "target")
    key = stage_key(cfg.data.traffic, window.prompts, window.reused, window.held_out)
    out = Path(cfg.workdir).absolute() / "traffic" / key
    written = write_window(window, str(out))
    hashes = sorted({row["id"][len("YYYY-MM-DD-"):] for row in window.prompts + window.reused})  # the trained rows
    written["trained_rows"] = str(files.write_text(out / "trained_rows.json", json.dumps(hashes)))
    warnings = list(window.warnings)
    _, warning = keep_held_out(written.get("held_out"), held_out_home(cfg), window.end)
    warnings += [warning] if warning else []
    regression = None
    if cfg.gate.enabled:  # the gate's regression set: the eval sets and the earlier windows' held-out slices
        questions, counts = regression_questions(held_out_home(cfg), window.end, written.get("held_out"),
                                                 cfg.gate.regression_max_questions)
        if questions:
            written["regression"] = str(files.write_text(out / "regression.jsonl", jsonl.dumps_rows(questions)))
        if counts["rejected"]:  # a kept slice's line that is no question (a hand edit, a cut file): counted
            said = ", ".join(f"{r['file']}:{r['line']} {r['reason']}" for r in counts["rejects"][:3])
            warnings.append(f"traffic: {counts['rejected']} lines of the kept held-out slices are not in the "
                            f"regression set ({said}{', ...' if counts['rejected'] > 3 else ''})")
        regression = RegressionCounts(**counts, eval_sets=len(cfg.eval.questions),
                                      max_questions=cfg.gate.regression_max_questions)
    return TrafficRecord(key=key, end=window.end, days=window.days, replay_days=window.replay_days,
                         counts=window.counts, warnings=warnings, files=TrafficFiles(**written), regression=regression)


def held_out_home(cfg: RunConfig) -> Path:
    """Where each window's held-out slice is kept, under its window's last day (``specdraft.freshness.traffic.keep_held_out``)."""
    return Path(cfg.workdir).absolute() / "traffic" / "heldout"


def _done(record: Regenerated | Dumped | Trained | Evaluated | Exported) -> dict[str, Any]:
    """What the DONE file holds: the record less ``skipped`` (a property of the run reading it)."""
    data = record.to_dict()
    del data["skipped"]
    return data


def regenerate_file(cfg: RunConfig, prepared: Prepared, prompt: PromptFile) -> Regenerated:
    """Regenerate the answers of one prompt file as ``regenerate.mode`` says (``pipelines/shipped.py``); a file of
    the served model's own logged answers (``prompt.reuse``) always ships as it is."""
    reuse = ["reuse"] if prompt.reuse else []  # (keys of files without reuse unchanged)
    # (mode_settings: target mode's keys as before the modes; data.regenerate: always true, kept for the same keys)
    key = stage_key(prepared.target_id, prompt.digest, mode_settings(cfg.regenerate), cfg.data.regenerate, *reuse)
    out = Path(cfg.workdir) / "regenerate" / key
    if (done := _finished(out)) is not None:
        return Regenerated.from_dict({**done, "skipped": True})
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    settings = replace(cfg.regenerate, mode="shipped", share=None) if prompt.reuse else cfg.regenerate
    if settings.mode != "shipped":  # shipped: no generation, no Ray
        ensure_ray(cfg)
    summary = regenerate(prepared.target, [prompt.path], out, settings)  # its progress lines too
    record = Regenerated(key=key, prompt=prompt.path, conversations=str(out), summary=summary,
                         wall_s=time.perf_counter() - started)
    _finish(out, _done(record))
    return record


def run_features(cfg: RunConfig) -> FeaturesConfig:
    """The features the run computes (dumped, or online as ``train.online``): its ``features`` section, with
    ``aux_layers: eagle3`` when the recipe reads EAGLE-3 features (the default ``beagle3`` does) and the
    section names no layers — as online training defaults them — so no run stops at training for a store
    without them."""
    return replace(cfg.features, aux_layers=aux_layers_setting(cfg.train, cfg.features.aux_layers))


def dump_file(cfg: RunConfig, prepared: Prepared, regenerated: Regenerated) -> Dumped:
    """Dump one regenerated prompt file to its own feature store (``run_features``) at ``store_location``; the
    stage's ``DONE`` record is ``<workdir>/features/<key>/DONE`` wherever the store is."""
    features = run_features(cfg)
    key = stage_key(prepared.target_id, regenerated.key, features)
    out = Path(cfg.workdir) / "features" / key
    if (done := _finished(out)) is not None:
        return Dumped.from_dict({**done, "skipped": True})
    ensure_ray(cfg)
    started = time.perf_counter()
    rows = read_conversations([regenerated.conversations])
    at = store_location(cfg, key)
    summary = dump_features(prepared.target, rows, at, features, progress=False)
    record = Dumped(key=key, store=str(at), summary=summary, wall_s=time.perf_counter() - started)
    _finish(out, _done(record))
    return record


def store_location(cfg: RunConfig, key: str) -> str | Path:
    """The feature store of dump ``key``: ``<store_root>/<key>`` (a directory or an object-store URL), or, with no
    ``store_root``, ``<workdir>/features/<key>`` (the stage's own directory, its ``DONE`` record beside the store)."""
    return location.join(cfg.store_root, key) if cfg.store_root else Path(cfg.workdir) / "features" / key


def train_config(cfg: RunConfig, stores: list[Dumped] | list[Regenerated]) -> ClusterTrainConfig:
    """The config training runs with: ``cfg.train``, and with online features (``train.features: online``,
    ``stores`` are then the regenerate records: no dump ran) the run's features (``run_features``) as
    ``train.online`` and the regenerated conversations (ordered by key) as ``train.conversations``."""
    if cfg.train.features != "online":
        return cfg.train
    assert all(isinstance(s, Regenerated) for s in stores), "online features train on the regenerate records"
    return replace(cfg.train, online=core_features(run_features(cfg)),  # the dump's actors are not the workers'
                   conversations=[s.conversations for s in sorted(stores, key=lambda s: s.key)])


def train(cfg: RunConfig, prepared: Prepared, stores: list[Dumped] | list[Regenerated],
          tracking: dict[str, str] | None = None, fail_at_step: int | None = None) -> Trained:
    """Train the draft on all stores (resumes a partial run of the same inputs), with ``train_config``."""
    keys = sorted(s.key for s in stores)
    train_cfg = train_config(cfg, stores)
    key = stage_key(prepared.target_id, keys, train_cfg, CODE_VERSION)
    out = Path(cfg.workdir) / "train" / key
    if (done := _finished(out)) is not None:
        return Trained.from_dict({**done, "skipped": True})
    ensure_ray(cfg)
    started = time.perf_counter()
    summary = run_training(train_cfg, [s.store for s in stores if isinstance(s, Dumped)], prepared.target, out,
                           tracking=tracking, ray_address=cfg.ray.address, fail_at_step=fail_at_step)
    record = Trained(key=key, draft=summary["draft"], metrics=summary["metrics"],
                     metrics_file=str(out / "metrics.jsonl"), wall_s=time.perf_counter() - started,
                     nodes=summary["nodes"])
    _finish(out, _done(record))
    return record


def eval_key(cfg: RunConfig) -> str:
    """Identity of the eval sets + settings: tau is only compared between equal keys."""
    files = [{"name": Path(q).name, "digest": file_digest(q)} for q in cfg.eval.questions]
    return stage_key(files, cfg.eval.settings)


def engine_gap_warnings(engine: dict[str, Any]) -> list[str]:
    """The engine report's warnings about the served draft (its acceptance against ours), less vanilla's (its passes
    disagreeing: the sweep's own, in the run summary's engine line, ``engine_sweep.sweep_note``)."""
    vanilla = set((engine.get("sweep") or {}).get("warnings") or [])
    return [w for w in engine.get("warnings") or [] if w not in vanilla]


def evaluate_draft(cfg: RunConfig, prepared: Prepared, draft_dir: str, draft_key: str) -> Evaluated:
    """Speculative decoding of the target with ``draft_dir`` on the eval sets, with the prompt-lookup
    floor (``tau_pld``, ``mean_tau_pld``: over the same datasets as ``tau``; empty / None when off)."""
    from pipelines.evaluate import evaluate
    from pipelines.configs import RayEvalConfig

    evals = eval_key(cfg)
    key = stage_key(draft_key, evals)
    out = Path(cfg.workdir) / "eval" / key
    if (done := _finished(out)) is not None:
        return Evaluated.from_dict({**done, "skipped": True})
    out.mkdir(parents=True, exist_ok=True)
    if cfg.eval.use_ray:
        ensure_ray(cfg)
    started = time.perf_counter()
    report = evaluate(prepared.target, draft_dir, cfg.eval.questions, out / "report.json", cfg.eval.settings,
                      use_ray=cfg.eval.use_ray, ray_cfg=RayEvalConfig(replicas=cfg.eval.replicas), progress=True,
                      baselines_home=Path(cfg.workdir) / "eval" / "baselines")  # shared by every draft evaluated
    taus = {name: d["tau"] for name, d in report["datasets"].items() if d["tau"] is not None}
    floors = {name: report["datasets"][name].get("tau_pld") for name in taus}  # the prompt-lookup floor
    floors = floors if taus and all(v is not None for v in floors.values()) else {}
    engine = report.get("engine") or {}  # the serving engine's measurement (eval.settings.engine)
    engine_tau = {name: d["acceptance_length"] for name, d in (engine.get("datasets") or {}).items()
                  if name in taus and d.get("acceptance_length") is not None}
    engine_tau = engine_tau if len(engine_tau) == len(taus) else {}
    engine_speedup = {name: d["speedup"] for name, d in (engine.get("datasets") or {}).items()
                      if name in engine_tau and d.get("speedup") is not None}
    record = Evaluated(key=key, eval_key=evals, report=str(out / "report.json"), tau=taus,
                       mean_tau=sum(taus.values()) / len(taus) if taus else None,
                       tau_pld=floors, tau_over_pld={name: taus[name] / v for name, v in floors.items()},
                       mean_tau_pld=sum(floors.values()) / len(floors) if floors else None,
                       engine_tau=engine_tau, engine_speedup=engine_speedup,
                       mean_engine_tau=sum(engine_tau.values()) / len(engine_tau) if engine_tau else None,
                       engine_warnings=engine_gap_warnings(engine), engine_best=best_of(engine.get("sweep")),
                       lossless_mismatches=sum(d.get("lossless_mismatches") or 0 for d in report["datasets"].values()),
                       wall_s=time.perf_counter() - started, nodes=report.get("nodes") or [])
    _finish(out, _done(record))
    return record


def export_formats(cfg: RunConfig, prepared: Prepared, draft_dir: str, draft_key: str) -> Exported:
    """Export the draft in every serving format that fits its architecture (``specdraft.export``) under
    ``<workdir>/export/<key>/<format>``. A draft no engine serves exactly (Beagle, a 0.1 EAGLE draft) gets no
    export and the reason (``note``); it stays registered and evaluable."""
    config = read_draft_config(draft_dir)
    arch = variant(config)
    if not cfg.register.export:
        return Exported(arch=arch, exports={}, note="export disabled (register.export=false)", wall_s=0.0)
    serving = cfg.register.serving
    key = stage_key(draft_key, prepared.target_id, serving, CODE_VERSION)
    out = Path(cfg.workdir) / "export" / key
    if (done := _finished(out)) is not None:
        return Exported.from_dict({**done, "skipped": True})
    started = time.perf_counter()
    exports, note = {}, ""
    try:
        for fmt in formats_for(config) or FORMATS[:1]:  # no format: the refusal says why
            exports[fmt] = str(export_draft(draft_dir, fmt, out / fmt, target=prepared.target,
                                            dtype=serving.dtype, speculative_tokens=serving.speculative_tokens,
                                            verifier=serving.verifier))
    except ExportError as err:
        exports, note = {}, str(err)
    record = Exported(key=key, arch=arch, exports=exports, note=note, wall_s=time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    _finish(out, _done(record))
    return record
