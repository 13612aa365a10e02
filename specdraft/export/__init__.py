"""Export a trained draft to the checkpoint formats serving engines load (docs/serving.md).

    export_draft(draft_dir, "speculators" | "sglang" | "eagle", out_dir, target=TARGET_DIR)

reads the draft directory (``config.json`` + ``model.safetensors``), takes what the engine
needs from the target (context length, dtype, verifier), writes the format into a temporary
directory, re-reads it with ``check_export`` and only then renames it into place — a failed
export leaves nothing behind. The output directory is the export's own (``specdraft/outputs.py``):
one of its inputs (the draft, the target, or a directory holding them) is refused, a non-empty
directory that is not an earlier export is refused unless ``overwrite``, and a replacement keeps
the files an export does not write. The files are readable by all (0755 / 0644), as the engine
may run as another user. Which formats fit which draft (``formats_for``):

=========  ===========================================  =====================================
draft      formats                                      engines
=========  ===========================================  =====================================
eagle3     speculators, sglang                          vLLM (both), SGLang (sglang)
eagle      sglang, eagle (HASS / EAGLE-1/2)             SGLang, the EAGLE reference
dflash     speculators (speculators type ``dflash``)    vLLM (``method: "dflash"``)
beagle     none (no engine serves Beagle drafts yet; nor the beagle-dflash block draft)
=========  ===========================================  =====================================
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from specdraft.export.check import check_export
from specdraft.export.commands import export_layout, serve_commands, sglang_command, speculative_config, vllm_command
from specdraft.export.llama import engine_tensors
from specdraft.export.spec import (
    DTYPES,
    FORMATS,
    LAYOUTS,
    ExportError,
    ExportSpec,
    VLLM_FORMATS,
    TargetFacts,
    default_speculative_tokens,
    formats_for,
    read_target_facts,
    variant,
    refuse_unknown_target,
    refuse_unservable,
)
from specdraft.export.writers import write_export
from specdraft.files import write_directory
from specdraft.models import ARCHS, read_draft_config
from specdraft.outputs import MARKER, OutputError, check_output, foreign_entries, marker_text
from specdraft.placement import resolve_dtype
from specdraft.preflight import check_target


def export_spec(
    draft_dir: str | Path,
    fmt: str,
    *,
    target: str | Path,
    dtype: str | None = None,
    speculative_tokens: int | None = None,
    verifier: str = "",
) -> ExportSpec:
    """What exporting ``draft_dir`` as ``fmt`` against ``target`` must produce (refusing what cannot be exact)."""
    config = read_draft_config(draft_dir)
    refuse_unservable(config, fmt)
    facts = read_target_facts(target)
    refuse_unknown_target(config, facts)
    dtype = dtype or facts.dtype
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r}: the target's config declares none of {list(DTYPES)}; pass one (--dtype)")
    speculative_tokens = default_speculative_tokens(config) if speculative_tokens is None else speculative_tokens
    if speculative_tokens < 1:
        raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    if config.drafts_blocks and speculative_tokens > config.block_size - 1:
        raise ExportError(f"speculative_tokens={speculative_tokens}: this block draft was trained on blocks of "
                          f"{config.block_size} (at most {config.block_size - 1} drafted tokens per step)")
    return ExportSpec(format=fmt, draft=config, target=facts, dtype=dtype, speculative_tokens=speculative_tokens,
                      verifier=verifier)


def export_draft(
    draft_dir: str | Path,
    fmt: str,
    out_dir: str | Path,
    *,
    target: str | Path,
    dtype: str | None = None,
    speculative_tokens: int | None = None,
    verifier: str = "",
    overwrite: bool = False,
) -> Path:
    """Export the draft directory ``draft_dir`` as ``fmt`` into ``out_dir`` (replaced atomically); returns it.

    ``out_dir`` must not be, be inside or hold ``draft_dir`` or ``target`` (``OutputError``); when it
    holds anything but an earlier export, ``overwrite`` lets the export write its files there, the
    others kept.
    """
    check_target(target, tokenizer=False)  # a pickle or weightless target: ConfigError (exit 2), as for every command
    check_output(out_dir, "export", inputs={"--draft": draft_dir, "--target": target}, overwrite=overwrite)
    spec = export_spec(draft_dir, fmt, target=target, dtype=dtype, speculative_tokens=speculative_tokens,
                       verifier=verifier)
    state = load_file(str(Path(draft_dir) / "model.safetensors"))
    try:  # the weights must be exactly the draft's parameters and buffers (no frozen target heads)
        ARCHS[spec.draft.arch](spec.draft).load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ExportError(f"{draft_dir}: weights do not match its config.json: {err}") from None
    with write_directory(out_dir, carry=foreign_entries(out_dir, EXPORT_FILES)) as tmp:
        write_export(state, spec, tmp)
        reference = engine_tensors(state, spec.layout.layer_prefix, resolve_dtype(spec.dtype, torch.device("cpu")),
                                   spec.vocab_maps)
        check_export(tmp, spec, reference)
        (tmp / MARKER).write_text(marker_text("export"))
    return Path(out_dir)


EXPORT_FILES = ("config.json", "model.safetensors")  # what ``write_export`` writes, every format


__all__ = [
    "FORMATS",
    "ExportError",
    "ExportSpec",
    "OutputError",
    "TargetFacts",
    "VLLM_FORMATS",
    "check_export",
    "export_draft",
    "export_spec",
    "export_layout",
    "formats_for",
    "variant",
    "speculative_config",
    "read_target_facts",
    "serve_commands",
    "sglang_command",
    "vllm_command",
]
