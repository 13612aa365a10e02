"""Build the toy target: a small Llama chat model trained on synthetic conversations.

docs/first-run.md "What the first run does": the laptop demo needs a real Hugging Face model directory
to stand in for a served LLM. ``build_toy_target`` generates conversations
(``conversations.py``; GSM8K-style word problems, ``word_problems.py``, with
``data=word_problems``), trains a byte-level BPE tokenizer with a chat template
(``tokenizer.py``), trains a ``LlamaForCausalLM`` (GQA, untied ``lm_head``) on the
assistant tokens of the rendered chats for a fixed number of AdamW steps, and writes a
complete directory: ``config.json``, ``model.safetensors``, ``generation_config.json``,
tokenizer files and ``toy_target.json`` (build config, losses, wall time).

The directory is assembled under a temporary sibling name and renamed into place
(``specdraft/files.py``), so a directory at ``out_dir`` is always complete; a complete build
with the same config is returned as is. Same config (and thread count) -> bitwise-identical weights.

Prebuilt: training the default config is most of a first ``specdraft run`` on a 2-core machine,
so the package ships that build in ``prebuilt/`` (about 1 MB; ``manifest.json`` holds each file's
sha256). ``build_toy_target(..., prebuilt=True)`` copies it when the config is the default one;
``specdraft toy-target`` retrains from scratch and ``compare_with_prebuilt`` tells how the result
differs from the shipped files (identical bytes on the same torch build and CPU; across CPUs, float
kernels may differ in the last bits). ``python -m specdraft.toy.build --write-prebuilt [BUILD_DIR]`` rewrites it.

CLI: ``python -m specdraft.toy.build OUT_DIR [train_steps=200 ...]`` (or ``--write-prebuilt [BUILD_DIR]``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm.auto import tqdm
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from specdraft.config import ConfigError, config_hash, from_dict, load, to_dict
from specdraft.configs.toy import ToyTargetConfig
from specdraft.files import remove_dead_temps, write_directory
from specdraft.outputs import MARKER, check_output, foreign_entries, marker_text
from specdraft.targets.identity import FINGERPRINT_CACHE
from specdraft.toy import conversations, word_problems
from specdraft.toy.tokenizer import END, train_tokenizer

BUILD_FORMAT = 1  # bump when the build changes in a way the config does not show
RECORD_FILE = "toy_target.json"
REQUIRED_FILES = (
    "config.json", "model.safetensors", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", RECORD_FILE,
)
PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"  # the default config's build, shipped
BUILD_FILES = (*REQUIRED_FILES, "chat_template.jinja")  # every file a build writes (+ the ownership marker)
COMMAND = "toy-target"  # the command whose output a build directory is (``specdraft.outputs``)
PREBUILT_MANIFEST = "manifest.json"  # in PREBUILT_DIR: {"config_hash", "files": {name: sha256}} of every file


# what a toy target is trained on: ``generate_conversations(n, seed)`` per family
DATA_FAMILIES = {
    "chat": conversations.generate_conversations,  # short templated chats, 1-3 turns
    "word_problems": word_problems.generate_conversations,  # GSM8K-style worked arithmetic problems
}


def build_toy_target(
    out_dir: str | Path, cfg: ToyTargetConfig = ToyTargetConfig(), progress: bool = True, prebuilt: bool = False,
    overwrite: bool = False,
) -> Path:
    """Build (or reuse) the toy target at ``out_dir``; returns the directory path.

    ``prebuilt``: copy the shipped build instead of training when ``cfg`` is its config. ``out_dir`` is
    checked as every command's ``--out`` (``specdraft.outputs.check_output``): an earlier build there
    is replaced, another non-empty directory is refused (``OutputError``) unless ``overwrite``, and
    then only the build's own files are replaced — the others are carried over as they were.
    """
    out_dir = Path(out_dir).absolute()
    if is_complete_build(out_dir, cfg):
        return out_dir
    check_output(out_dir, COMMAND, overwrite=overwrite, own=(RECORD_FILE,))
    remove_dead_temps(out_dir)  # left by killed builds
    carry = [name for name in foreign_entries(out_dir, BUILD_FILES) if name != FINGERPRINT_CACHE]
    # a concurrent builder that finished first keeps its build
    with write_directory(out_dir, keep=lambda done: is_complete_build(done, cfg), carry=carry) as tmp:
        if prebuilt and same_config(prebuilt_config(), cfg):
            for name in _manifest()["files"]:
                shutil.copyfile(PREBUILT_DIR / name, tmp / name)
        else:
            _build_into(tmp, cfg, progress)
        (tmp / MARKER).write_text(marker_text(COMMAND))
    return out_dir


def is_complete_build(out_dir: str | Path, cfg: ToyTargetConfig | None = None) -> bool:
    """True when ``out_dir`` holds a finished build (of ``cfg``, when given)."""
    out_dir = Path(out_dir)
    if not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        record = read_build_record(out_dir)
    except (OSError, ValueError):
        return False
    if record.get("build_format") != BUILD_FORMAT:
        return False
    return cfg is None or same_config(record.get("config"), cfg)


def same_config(recorded: dict[str, Any] | None, cfg: ToyTargetConfig) -> bool:
    """Whether a build record's config is ``cfg`` (a field added since the record was written holds its
    default); False for a missing or unreadable one."""
    try:
        return recorded is not None and from_dict(ToyTargetConfig, recorded) == cfg
    except ConfigError:
        return False


def read_build_record(out_dir: str | Path) -> dict[str, Any]:
    """The ``toy_target.json`` of a build: config, config_hash, losses, wall time."""
    return json.loads((Path(out_dir) / RECORD_FILE).read_text())


# ---------------------------------------------------------------- the shipped build


def file_digests(out_dir: str | Path) -> dict[str, str]:
    """sha256 of every file of a build directory (but a manifest and hidden files: caches, temporaries), by name."""
    files = sorted(p for p in Path(out_dir).iterdir()
                   if p.is_file() and p.name != PREBUILT_MANIFEST and not p.name.startswith("."))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _manifest() -> dict[str, Any]:
    return json.loads((PREBUILT_DIR / PREBUILT_MANIFEST).read_text())


def prebuilt_config() -> dict[str, Any] | None:
    """The config (as a dict) of the shipped build, or None when none ships or it is not intact."""
    try:
        if not is_complete_build(PREBUILT_DIR) or file_digests(PREBUILT_DIR) != _manifest()["files"]:
            return None
        return read_build_record(PREBUILT_DIR)["config"]
    except (OSError, ValueError, KeyError):
        return None


def write_prebuilt(source: str | Path | None = None, progress: bool = True) -> Path:
    """Write ``PREBUILT_DIR`` and its manifest (maintainers): a copy of ``source``, a complete build of
    the default config, or else a fresh build of it."""
    shutil.rmtree(PREBUILT_DIR, ignore_errors=True)
    if source is not None:
        assert is_complete_build(source, ToyTargetConfig()), f"{source} is not a build of the default config"
        shutil.copytree(source, PREBUILT_DIR)
    else:
        build_toy_target(PREBUILT_DIR, ToyTargetConfig(), progress=progress)
    manifest = {"config_hash": config_hash(ToyTargetConfig()), "files": file_digests(PREBUILT_DIR)}
    (PREBUILT_DIR / PREBUILT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return PREBUILT_DIR


def compare_with_prebuilt(out_dir: str | Path) -> dict[str, Any]:
    """How a build differs from the shipped one: ``same_config``, ``identical_files`` (name -> bytes
    equal, for every shipped file but the record of wall times and versions) and
    ``max_abs_weight_diff`` over all tensors (None when the tensor names or shapes differ)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    shipped_config = prebuilt_config()
    if shipped_config is None:
        return {"same_config": False, "identical_files": {}, "max_abs_weight_diff": None}
    try:
        same = same_config(read_build_record(out_dir)["config"], from_dict(ToyTargetConfig, shipped_config))
    except ConfigError:
        same = False
    ours, shipped = file_digests(out_dir), _manifest()["files"]
    a, b = load_file(out_dir / "model.safetensors"), load_file(PREBUILT_DIR / "model.safetensors")
    diff = (max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a.keys() == b.keys()
            and all(a[k].shape == b[k].shape for k in a) else None)
    return {"same_config": same,
            "identical_files": {n: ours.get(n) == digest for n, digest in shipped.items() if n != RECORD_FILE},
            "max_abs_weight_diff": diff}


# ---------------------------------------------------------------- the build


def _build_into(tmp: Path, cfg: ToyTargetConfig, progress: bool) -> None:
    started = time.perf_counter()
    generate = DATA_FAMILIES[cfg.data]
    convs = generate(cfg.num_conversations, cfg.seed)
    tokenizer = train_tokenizer((m["content"] for c in convs for m in c), cfg.vocab_size)
    train_rows = encode_conversations(tokenizer, convs, cfg)
    eval_rows = encode_conversations(tokenizer, generate(cfg.num_eval_conversations, cfg.seed + 1), cfg)

    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = make_model(cfg, tokenizer)
            stats = train_model(model, train_rows, eval_rows, cfg, progress)
    finally:
        torch.set_num_threads(old_threads)

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(END),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    )
    bars_were_disabled = hf_logging.is_progress_bar_enabled() is False
    if not progress:
        hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
    try:
        model.save_pretrained(tmp)
    finally:
        if not progress and not bars_were_disabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    record = {
        "build_format": BUILD_FORMAT,
        "config": to_dict(cfg),
        "config_hash": config_hash(cfg),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        **stats,
        "wall_time_s": round(time.perf_counter() - started, 3),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")  # written last


def make_model(cfg: ToyTargetConfig, tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A freshly initialised small Llama (float32, sdpa attention)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(END),
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def encode_conversations(
    tokenizer: PreTrainedTokenizerFast, conversations: list[list[dict[str, str]]], cfg: ToyTargetConfig
) -> list[tuple[list[int], list[int]]]:
    """Chat-template token ids and labels (-100 where no loss) per conversation, truncated."""
    enc = tokenizer.apply_chat_template(conversations, return_assistant_tokens_mask=True)
    rows = []
    for ids, mask in zip(enc["input_ids"], enc["assistant_masks"]):
        ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
        labels = [t if (m or not cfg.assistant_only_loss) else -100 for t, m in zip(ids, mask)]
        rows.append((ids, labels))
    return rows


def _batches(rows: list[tuple[list[int], list[int]]], cfg: ToyTargetConfig, rng: random.Random):
    """Endless length-bucketed batches: shuffle, sort within chunks of 32 batches, shuffle batches."""
    while True:
        order = list(range(len(rows)))
        rng.shuffle(order)
        chunk = 32 * cfg.batch_size
        batches = []
        for start in range(0, len(order), chunk):
            part = sorted(order[start : start + chunk], key=lambda i: len(rows[i][0]))
            batches += [part[i : i + cfg.batch_size] for i in range(0, len(part), cfg.batch_size)]
        rng.shuffle(batches)
        yield from batches


def _collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` [B, T]. Pads sit after every real token, so a
    causal model needs no attention mask: real positions never see them and their labels are -100."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # [B, T]
    for b, (ids, lab) in enumerate(rows):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        labels[b, : len(lab)] = torch.tensor(lab)
    return input_ids, labels


def _lr_at(step: int, cfg: ToyTargetConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.train_steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def train_model(
    model: LlamaForCausalLM,
    train_rows: list[tuple[list[int], list[int]]],
    eval_rows: list[tuple[list[int], list[int]]],
    cfg: ToyTargetConfig,
    progress: bool = True,
) -> dict[str, Any]:
    """AdamW on causal-LM loss for ``cfg.train_steps`` steps; returns loss statistics."""
    pad_id = model.config.pad_token_id
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95), foreach=False,
    )
    batches = _batches(train_rows, cfg, random.Random(cfg.seed))
    losses: list[float] = []
    tokens = 0
    started = time.perf_counter()
    model.train()
    bar = tqdm(range(cfg.train_steps), desc="toy target", disable=not progress, file=sys.stderr)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        input_ids, labels = _collate([train_rows[i] for i in next(batches)], pad_id)
        loss = causal_lm_loss(model, input_ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        tokens += int((labels != -100).sum())
        if step % 10 == 0 or step == cfg.train_steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if cfg.max_train_seconds is not None and time.perf_counter() - started > cfg.max_train_seconds:
            break
    bar.close()
    train_time = time.perf_counter() - started
    tail = losses[-max(1, len(losses) // 10):]
    return {
        "steps": len(losses),
        "final_loss": round(sum(tail) / len(tail), 5),  # mean over the last 10% of steps
        "eval_loss": round(evaluate_loss(model, eval_rows, cfg), 5),
        "loss_curve": [[i, round(v, 4)] for i, v in enumerate(losses) if i % 10 == 0],
        "trained_tokens": tokens,
        "train_time_s": round(train_time, 3),
    }


def causal_lm_loss(model: LlamaForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled positions; equals ``model(labels=...).loss``
    but runs ``lm_head`` only where a label exists (about 40% of positions, ~10% faster)."""
    hidden = model.model(input_ids=input_ids).last_hidden_state  # [B, T, d]
    targets = labels[:, 1:]  # [B, T-1]
    keep = targets != -100  # [B, T-1]
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits, targets[keep])


@torch.no_grad()
def evaluate_loss(
    model: LlamaForCausalLM, rows: list[tuple[list[int], list[int]]], cfg: ToyTargetConfig
) -> float:
    """Token-weighted mean loss over ``rows``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), cfg.batch_size):
        input_ids, labels = _collate(rows[start : start + cfg.batch_size], model.config.pad_token_id)
        n = int((labels[:, 1:] != -100).sum())
        if n:
            total += causal_lm_loss(model, input_ids, labels).item() * n
            count += n
    model.train()
    return total / max(1, count)


# ---------------------------------------------------------------- directory handling


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    if args[0] == "--write-prebuilt":  # [FROM_DIR]: a finished build of the default config
        print(f"wrote {write_prebuilt(args[1] if len(args) > 1 else None)}")
        return
    cfg = load(ToyTargetConfig, None, args[1:])
    path = build_toy_target(args[0], cfg)
    print(json.dumps({k: v for k, v in read_build_record(path).items() if k != "loss_curve"}, indent=2))


if __name__ == "__main__":
    main()
