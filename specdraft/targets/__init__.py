"""The target: the served LLM a draft learns to predict ("EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", §3: the draft reads the target's features and reuses its embedding and lm_head).

``Target`` is the value a run carries: the model directory, checked once when the value is made (a local
directory holding a ``config.json``), and what is read of it cached on it — its config, its tokenizer's
facts, its fingerprint and id — so a run reads each once however many stages ask. Make it where a run
starts (``Target.of(path)``: a command, a flow, a pipeline stage) and hand it down; every function of this
package takes a ``Target`` or a path (a path is checked again, as a new ``Target``).

The package, one module per job (none imports this one's siblings but ``checkpoint``):

* ``checkpoint``: the directory's safetensors files, where each tensor lives, the strict check of a load;
* ``loading``: its config, tokenizer (and the tokenizer's facts), embedding and lm_head, full model;
* ``states``: one prefill's last hidden state, logits and auxiliary-layer states (EAGLE-3 features);
* ``identity``: its content fingerprint, the id that keys every stage, and the pairing check every
  artifact made from it passes (docs/guarantees.md).

Only local directories are read here; fetching a hub id is the caller's job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A target model directory (its resolved path), checked once; ``cached`` keeps what is read of it (config,
    fingerprint, ...).

    Equal (and hashed) by ``path`` alone; the cache travels with the value (a Ray worker gets it pickled).
    """

    path: Path
    _cache: dict[Any, Any] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = self.path
        path = Path(given)
        if not path.is_dir():
            raise FileNotFoundError(f"target {str(given)!r} is not a local directory")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target directory {str(path)!r} has no config.json")
        object.__setattr__(self, "path", path.resolve())  # what a worker elsewhere (another cwd) reads

    @classmethod
    def of(cls, target: Target | str | Path) -> Target:
        """``target`` itself when it is a ``Target``, else a new one (its path checked)."""
        return target if isinstance(target, Target) else cls(target)

    def cached(self, key: Any, compute: Callable[[], _T]) -> _T:
        """``compute()``'s value, computed the first time ``key`` is asked for on this value."""
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)
