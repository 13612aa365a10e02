"""A target's checkpoint on disk ("EAGLE", §3: the draft reuses the target's own weights, so they must be the
model its ``config.json`` describes): the directory, its safetensors files, where each tensor lives, and the
strict check of a load (docs/guarantees.md: a checkpoint whose weights disagree with its config is refused).

``specdraft.targets.loading`` loads and ``specdraft.targets.identity`` fingerprints a target through these; only
local directories are read (``specdraft.targets.Target`` checked the directory once).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from safetensors import safe_open

from specdraft.config import ConfigError
from specdraft.targets import Target

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class TargetWeightsError(ConfigError):
    """A target whose weights are not those its ``config.json`` describes (a layer too many or too few, a
    tensor of another shape): refused wherever it is loaded, never loaded truncated or half-initialised."""


def weight_files(root: Path) -> list[Path]:
    """The target's ``*.safetensors`` files, sorted by name."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {str(root)!r}")
    return files


def tensor_locations(root: Path) -> dict[str, Path]:
    """Map every tensor name in the target's safetensors to the file that holds it."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        return {name: root / shard for name, shard in weight_map.items()}
    single = root / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in root.iterdir() if p.is_file())
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {str(root)!r} (found {found}); "
        "only safetensors checkpoints are supported"
    )


def check_loading_info(root: Path, info: Mapping[str, Iterable]) -> None:
    """Refuse a load whose weights and config disagree: ``info`` is ``from_pretrained``'s
    ``output_loading_info`` (tensors the checkpoint holds that the config's model has no place for, places
    the checkpoint leaves empty, tensors of another shape). ``TargetWeightsError``, one line naming the
    directory, its ``config.json`` and a few of the keys."""
    kinds = {"unexpected": "in the weights but not in the model config.json describes",
             "missing": "in the model config.json describes but not in the weights",
             "mismatched": "of another shape in the weights"}
    found = {kind: sorted(map(str, info.get(f"{kind}_keys") or ())) for kind in kinds}
    parts = [f"{len(keys)} tensor(s) {kinds[kind]} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
             for kind, keys in found.items() if keys]
    if parts:
        raise TargetWeightsError(
            f"target {root}: its weights are not the model its {root / 'config.json'} describes: {'; '.join(parts)} "
            "— give the config.json that came with these weights")


def check_target_weights(target: Target | str | Path, trust_remote_code: bool = False) -> None:
    """The strict load's check without the load, for a pre-flight before Ray or a worker starts: the model
    ``config.json`` describes is built on the meta device (no memory, no tensor read into it) and the
    checkpoint's tensor names and shapes compared with it (``check_loading_info``)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    root = Target.of(target).path
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # transformers' table of the keys (the line below says it) and its bar: off
    logging.disable_progress_bar()
    try:
        _, info = AutoModelForCausalLM.from_pretrained(root, device_map="meta", output_loading_info=True,
                                                       use_safetensors=True, trust_remote_code=trust_remote_code)
    except SafetensorError as err:  # a weights file cut short or not safetensors: one line naming it, not a traceback
        raise TargetWeightsError(f"target {root}: its safetensors weights cannot be read ({err}) — a file cut short "
                                 "or not safetensors; copy the checkpoint again") from None
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()
    check_loading_info(root, info)
