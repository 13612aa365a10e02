"""The peer's training for ``benchmarks.peer_speculators``: speculators' EAGLE-3 trainer on a CPU, patched at run time.

"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test" (§3) as the
``speculators`` package trains it (``speculators train``: ``TrainConfig.resolve`` then ``speculators.train.cli.main``),
run in speculators' own virtual environment as

    VENV/bin/python -m benchmarks.peer_speculators_train REQUEST.json RESULT.json

(``benchmarks.peer_speculators`` writes the request and reads the result). Nothing in site-packages is edited;
``PATCHES`` below are applied by ``patch_for_cpu`` in this process only, each one line in the result JSON.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.host import write_result

PATCHES = [
    "speculators.train.trainer.get_local_rank -> 'cpu': the trainer's `.to(self.local_rank)` of the model and of "
    "every train/val batch moves to cuda:0 otherwise",
    "speculators.train.trainer._StepTimer.mark / .now without torch.accelerator.synchronize() (it raises 'Cannot "
    "access accelerator device when none is available'; CPU work is synchronous, the timestamps are the same)",
    "Trainer.device_type = 'cpu' (a subclass installed as speculators.train.cli.Trainer): upstream falls back to "
    "'cuda' for torch.autocast when no accelerator is present",
    "Eagle3DraftModel.verifier_norm -> torch.nn.Identity (data format, not CPU): our store's last hidden state is "
    "already the target's final-normed state (what its lm_head reads); speculators' data holds the pre-norm one",
    "speculators.train.cli.create_train_val_loaders(max_train_batches=steps // epochs): each epoch its first "
    "steps // epochs packed batches, as real_model.py's epoch_batches (speculators sizes its LR schedule to them)",
    "instrumentation only: the train loader wrapped to count steps, positions (document_ids != -1) and loss-masked "
    "tokens; Trainer.train_epoch / val_epoch timed",
]
FLAGS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0", "--on-missing", "raise", "--checkpoint-freq", "1",
         "--no-resume-from-checkpoint"]  # flex attention and the fused (Triton) losses need a GPU; no vLLM to generate states


def vocab_mappings(data: Path, token_freq: dict[int, int], draft_vocab: int, target: str) -> None:
    """``d2t-V.npy`` / ``t2d-V.npy`` in ``data`` from the token counts, by speculators' own function (the files
    its trainer loads for ``--draft-vocab-size V``)."""
    import numpy as np

    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution, get_target_vocab_size

    d2t, t2d = build_vocab_mappings_from_distribution(token_freq_dict=token_freq, draft_vocab_size=draft_vocab,
                                                      target_vocab_size=get_target_vocab_size(None, target))
    np.save(data / f"d2t-{draft_vocab}.npy", d2t.cpu().numpy())
    np.save(data / f"t2d-{draft_vocab}.npy", t2d.cpu().numpy())


def patch_for_cpu(batches_per_epoch: int, stats: dict[str, Any]) -> None:
    """Apply ``PATCHES`` (in this process); ``stats`` collects steps, tokens and the timed epochs."""
    import torch

    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: "cpu"

    def mark(timer, name: str) -> None:
        if timer.enabled:
            timer._marks[name] = time.perf_counter()

    trainer_module._StepTimer.mark = mark
    trainer_module._StepTimer.now = lambda timer: time.perf_counter() if timer.enabled else None
    loaders = cli.create_train_val_loaders
    cli.create_train_val_loaders = lambda **kw: loaders(**kw, max_train_batches=batches_per_epoch)

    class Counted:
        """The train loader as the trainer uses it (len, batch_sampler, iteration), counting what it hands out."""

        def __init__(self, loader) -> None:
            self.loader, self.batch_sampler = loader, loader.batch_sampler

        def __len__(self) -> int:
            return len(self.loader)

        def __iter__(self):
            for batch in self.loader:
                stats["steps"] += 1
                stats["tokens"] += int((batch["document_ids"] != -1).sum())
                stats["loss_tokens"] += int(batch["loss_mask"].sum())
                yield batch

    class CPUTrainer(cli.Trainer):
        def __init__(self, model, config, train_loader, val_loader=None) -> None:
            model.verifier_norm = torch.nn.Identity()
            super().__init__(model, config, Counted(train_loader), val_loader)
            self.device_type = "cpu"

        def train_epoch(self, epoch: int, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return super().train_epoch(epoch, **kw)
            finally:
                stats["train_s"] += time.perf_counter() - t0
                stats["train_cpu_s"] += time.process_time() - c0

        def val_epoch(self, epoch: int):
            t0 = time.perf_counter()
            metrics = super().val_epoch(epoch)
            stats["val_s"] += time.perf_counter() - t0
            stats["val"].append({"epoch": epoch, **{k: round(float(v), 4) for k, v in (metrics or {}).items()}})
            return metrics

    cli.Trainer = CPUTrainer


def train(request: dict[str, Any]) -> dict[str, Any]:
    import torch

    from benchmarks.peer_speculators import convert_store

    torch.set_num_threads(request["threads"])
    work = Path(request["work"])
    data = work / "data"
    converted = convert_store(Path(request["store"]), data, request["val_fraction"], request.get("samples"))
    vocab = json.loads((Path(request["target"]) / "config.json").read_text())["vocab_size"]
    draft_vocab = request["draft_vocab"] if request["draft_vocab"] and request["draft_vocab"] < vocab else None
    if draft_vocab:
        freq = {int(k): v for k, v in json.loads((data / "token_freq.json").read_text()).items()}
        vocab_mappings(data, freq, draft_vocab, request["target"])

    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    stats: dict[str, Any] = {"steps": 0, "tokens": 0, "loss_tokens": 0, "train_s": 0.0, "train_cpu_s": 0.0,
                             "val_s": 0.0, "val": []}
    per_epoch = request["steps"] // request["epochs"]
    patch_for_cpu(per_epoch, stats)
    save = work / "checkpoints"
    shutil.rmtree(save, ignore_errors=True)  # a fresh run: no earlier epoch's checkpoint left to serve
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", request["target"],
            "--data-path", str(data), "--hidden-states-path", str(data / "hidden_states"),
            "--save-path", str(save), "--log-dir", str(work / "logs"),
            "--total-seq-len", str(request["max_tokens"]), "--epochs", str(request["epochs"]),
            "--train-data-ratio", str(converted["train_data_ratio"]),
            "--target-layer-ids", *[str(i) for i in converted["aux_layers"]],
            "--hidden-states-dtype", {"bf16": "bfloat16", "fp32": "float32"}[request["precision"]],
            "--seed", str(request["seed"]), *FLAGS]
    if draft_vocab:
        argv += ["--draft-vocab-size", str(draft_vocab), "--d2t-path", str(data / f"d2t-{draft_vocab}.npy"),
                 "--t2d-path", str(data / f"t2d-{draft_vocab}.npy")]
    if request.get("lr"):
        argv += ["--lr", str(request["lr"])]
    cfg = TrainConfig.resolve(argv)
    t0 = time.perf_counter()
    speculators_train(cfg)
    run_s = time.perf_counter() - t0
    draft = save / str(request["epochs"] - 1)  # the last epoch's checkpoint (checkpoint_freq 1)
    if not (draft / "config.json").is_file():
        raise RuntimeError(f"{draft}: no checkpoint written")
    from importlib.metadata import version

    flat = cfg.flatten()
    return {
        "trainer": f"speculators {version('speculators')}", "speculator_type": "eagle3", "draft": str(draft),
        "patches": PATCHES, "flags": FLAGS, "argv": argv,
        "settings": {k: flat[k] for k in ("optimizer", "lr", "scheduler_type", "loss_fn", "ttt_steps", "epochs",
                                          "total_seq_len", "hidden_states_dtype", "draft_attn_impl", "num_layers",
                                          "norm_before_residual", "norm_output", "norm_before_fc", "draft_vocab_size",
                                          "target_layer_ids") if k in flat},
        "data": converted, "batches_per_epoch": per_epoch, "optimizer_steps": stats["steps"],
        # tokens as real_model.py counts them (the trainer's state.tokens: loss-masked positions), and all positions
        "train_tokens": stats["loss_tokens"], "train_positions": stats["tokens"], "train_s": round(stats["train_s"], 2),
        "tokens_per_s": round(stats["loss_tokens"] / max(stats["train_s"], 1e-9), 1),
        "positions_per_s": round(stats["tokens"] / max(stats["train_s"], 1e-9), 1),
        "cpu_share": round(stats["train_cpu_s"] / max(stats["train_s"], 1e-9), 3),
        "validation_s": round(stats["val_s"], 2), "val": stats["val"], "run_s": round(run_s, 2),
        "threads": request["threads"],
    }


def main(argv: list[str] | None = None) -> int:
    request_path, result_path = (argv or sys.argv[1:])[:2]
    result = train(json.loads(Path(request_path).read_text()))
    write_result(result_path, result)  # the host's facts as the speculators environment sees them
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
