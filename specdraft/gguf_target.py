"""A target model directory from a GGUF file (``specdraft import-target``).

A GGUF file (llama.cpp's single-file format: quantized weights, tokenizer, chat template) becomes an
ordinary safetensors model directory that every command reads like any target: ``config.json``,
``model.safetensors``, ``generation_config.json``, the tokenizer files and ``chat_template.jinja``,
fingerprinted (``specdraft.targets.identity.target_record``) and recorded in ``gguf_import.json``.

transformers (with the ``gguf`` package) dequantizes the file (``from_pretrained(dir, gguf_file=...)``);
the model it loads carries a GGUF quantization marker that ``save_pretrained`` refuses, so a plain model is
rebuilt from its config (the marker dropped) and its state dict, strictly, before saving. Only
architectures specdraft's targets are made of are converted (``GGUF_ARCHITECTURES``); any other, or a file that
is not GGUF, is a ``GGUFImportError`` with one line, read from the file's header before any weight is.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from specdraft.files import write_directory, write_text
from specdraft.outputs import MARKER, check_output, foreign_entries, marker_text
from specdraft.targets.identity import FINGERPRINT_CACHE, target_record

COMMAND = "import-target"
RECORD_FILE = "gguf_import.json"  # what was imported from where: the file, its architecture, dtype, fingerprint
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # GGUF general.architecture -> the transformers class written
IMPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GGUF_MAGIC = b"GGUF"
OWN_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "special_tokens_map.json", RECORD_FILE)


class GGUFImportError(ValueError):
    """A file that cannot become a target: not GGUF, or an architecture this importer does not convert."""


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` of the GGUF file ``path`` (its header only; raises ``GGUFImportError``)."""
    path = Path(path)
    with open(path, "rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise GGUFImportError(f"{path} is not a GGUF file (its first bytes are not {GGUF_MAGIC!r})")
    from gguf import GGUFReader  # the transformers GGUF loader needs it too: pip install 'specdraft[real]'

    try:
        field = GGUFReader(path).fields.get("general.architecture")
    except (ValueError, IndexError, OSError) as err:
        raise GGUFImportError(f"{path}: unreadable GGUF header: {err}") from None
    if field is None:
        raise GGUFImportError(f"{path}: the GGUF header has no general.architecture")
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def check_architecture(path: str | Path) -> str:
    """The transformers class ``path``'s architecture becomes; ``GGUFImportError`` when it has none here."""
    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFImportError(f"{path}: architecture {arch!r} cannot be converted (import-target converts "
                              f"{', '.join(sorted(GGUF_ARCHITECTURES))})")
    return GGUF_ARCHITECTURES[arch]


def dequantized_model(path: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """The GGUF file's model as a plain transformers model in ``dtype`` (no quantization marker), and its
    tokenizer. transformers dequantizes to fp32; the plain model gets the same state dict, strictly."""
    kwargs = {"gguf_file": path.name, "trust_remote_code": False}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    config = loaded.config
    config.quantization_config = None
    del config.quantization_config  # the GGUF marker: a plain config has none
    config.dtype = dtype
    cls = getattr(transformers, GGUF_ARCHITECTURES[gguf_architecture(path)])
    with torch.device("meta"):
        plain = cls(config)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    return plain.to(dtype).eval(), tokenizer


def generation_config(model: torch.nn.Module, tokenizer: Any) -> transformers.GenerationConfig:
    """Greedy decoding that stops at the chat template's end of turn (the tokenizer's eos) and the model's eos."""
    eos = [i for i in dict.fromkeys([tokenizer.eos_token_id, model.config.eos_token_id]) if i is not None]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model.config.pad_token_id
    return transformers.GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos,
                                         pad_token_id=pad, do_sample=False)


def import_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: str = "bf16",
                overwrite: bool = False) -> dict[str, Any]:
    """Write the target model directory ``out_dir`` from ``gguf_file``; returns its record (``RECORD_FILE``).

    ``out_dir`` is checked as every command's ``--out`` (``specdraft.outputs``): an earlier import there is
    replaced whole, another non-empty directory is refused unless ``overwrite`` (then only the import's
    files are replaced). The directory appears complete or not at all (``specdraft.files.write_directory``).
    """
    if dtype not in IMPORT_DTYPES:
        raise GGUFImportError(f"dtype {dtype!r}: one of {', '.join(IMPORT_DTYPES)}")
    path = Path(gguf_file).resolve()
    if not path.is_file():
        raise GGUFImportError(f"{gguf_file}: no such file")
    architecture = check_architecture(path)
    check_output(out_dir, COMMAND, inputs={"--gguf": path}, overwrite=overwrite, own=(RECORD_FILE,))
    started = time.perf_counter()
    model, tokenizer = dequantized_model(path, IMPORT_DTYPES[dtype])
    model.generation_config = generation_config(model, tokenizer)
    carry = [name for name in foreign_entries(out_dir, OWN_FILES) if name != FINGERPRINT_CACHE]
    with write_directory(out_dir, carry=carry) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(marker_text(COMMAND))
    record = {"gguf": str(path), "gguf_bytes": path.stat().st_size, "architecture": architecture, "dtype": dtype,
              "parameters": sum(p.numel() for p in model.parameters()), "layers": model.config.num_hidden_layers,
              "vocab_size": model.config.vocab_size, "chat_template": bool(tokenizer.chat_template),
              **target_record(out_dir), "convert_s": round(time.perf_counter() - started, 1)}
    write_text(Path(out_dir) / RECORD_FILE, json.dumps(record, indent=2) + "\n")
    return record
