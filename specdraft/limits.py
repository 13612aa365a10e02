"""A stage's speed limit on this machine, and how close the stage came to it (issue 41, item 4; docs/first-run.md
"What a run says", the rates).

The limit of a stage is ``matmul FLOP/s / FLOPs per token``:

* **matmul FLOP/s** (``measure_matmul``): a (m, k) @ (k, n) product timed for about a second on the stage's device,
  dtype and thread count, in the shape of the target's MLP (``mlp_shape``: 2048 tokens on CPU, 8192 on a GPU, by
  hidden and intermediate size; without a config, SmolLM2's (2048, 576, 1536) on CPU, an 8B's (8192, 4096, 14336)
  on a GPU).
  It is measured in the run it is held against and kept in that run's workdir (``RunReferences``): a figure
  measured in another run, under another load, is never read back (a ratio's two times come from one run).
* **FLOPs per token**: a forward costs ``2 x`` the matmul parameters per token (``forward_flops``: regenerate and
  the dump); a training step ``6 x`` the draft's matmul parameters (forward 2, backward 4) ``x`` the sub-steps it
  unrolls per position (``train_flops``: 1 for a one-step stage, k for a training-time test over k steps).
  Matmul parameters (``matmul_parameters``): every 2-D weight of the checkpoint but a token embedding, which is a
  lookup — unless the output head is tied to it, when it is counted once as the head. Attention's own products
  (quadratic in the length), norms and activations are not counted: the limit is a ceiling the stage cannot pass.

``stage_rate`` puts a stage's tokens and wall time beside its limit: tokens/s, limit tokens/s, their ratio, and one
line saying how the limit was computed. ``LoadSampler`` samples the load average while a stage (or a benchmark)
runs, to stand beside its rate.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from specdraft import files

CPU_SHAPE = (2048, 576, 1536)  # (tokens, d, 8d/3): SmolLM2-135M's MLP
GPU_SHAPE = (8192, 4096, 14336)  # a Llama-3-8B MLP over 8192 tokens
MEASURE_S = 1.0  # seconds of products per measurement
FILE = "rates.json"  # in the run's workdir: this run's references and stages (``RunReferences``)


class LoadSampler:
    """Samples the host's 1-minute load average every ``every`` seconds in a thread."""

    def __init__(self, every: float = 2.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> Self:
        self.start = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = os.getloadavg()

    def summary(self) -> dict[str, Any]:
        s = self.samples or [float("nan")]
        return {
            "cpus": os.cpu_count(),
            "load_1m_min": round(min(s), 2), "load_1m_mean": round(sum(s) / len(s), 2), "load_1m_max": round(max(s), 2),
            "loadavg_start": [round(x, 2) for x in self.start],
            "loadavg_end": [round(x, 2) for x in getattr(self, "end", None) or os.getloadavg()],  # now, while running
            "samples": len(self.samples), "sample_every_s": self.every,
            "note": "includes the measuring process's own load",
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class Matmul:
    """One measurement of the machine's matmul speed."""

    device: str  # "cpu" or "cuda"
    dtype: str  # "float32", "bfloat16", "float16"
    threads: int  # torch CPU threads (on a GPU: those of the measuring process)
    shape: tuple[int, int, int]  # (m, k, n)
    flops: float  # FLOP/s
    seconds: float  # timed
    load_1m: float  # the 1-minute load average when it ended
    run: str  # the run it was measured in

    @property
    def key(self) -> str:
        return reference_key(self.device, self.dtype, self.threads, self.shape)


def reference_key(device: str, dtype: str, threads: int, shape: tuple[int, int, int] | None = None) -> str:
    m, k, n = shape or default_shape(device)
    return f"{device}/{dtype}/{threads}/{m}x{k}x{n}"


def default_shape(device: str) -> tuple[int, int, int]:
    return GPU_SHAPE if device == "cuda" else CPU_SHAPE


def mlp_shape(model_dir: str | Path, device: str) -> tuple[int, int, int] | None:
    """(tokens, hidden, intermediate) of ``model_dir``'s MLP (its config.json; None without one)."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config = config.get("text_config", config)
    if not config.get("hidden_size") or not config.get("intermediate_size"):
        return None
    return default_shape(device)[0], int(config["hidden_size"]), int(config["intermediate_size"])


def measure_matmul(device: str, dtype: str, threads: int, *, run: str = "", shape: tuple[int, int, int] | None = None,
                   seconds: float = MEASURE_S) -> Matmul:
    """FLOP/s of a (m, k) @ (k, n) product repeated for ``seconds`` on ``device`` at ``dtype`` with ``threads`` torch
    threads (restored after)."""
    import torch

    m, k, n = shape or default_shape(device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dt = getattr(torch, dtype)
        a, b = torch.randn(m, k, dtype=dt, device=device), torch.randn(k, n, dtype=dt, device=device)  # (m,k) (k,n)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for _ in range(2):
            a @ b  # warm the kernels
        sync()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds or count == 0:
            a @ b  # (m, n)
            count += 1
            if device == "cuda" and count % 8 == 0:
                sync()
        sync()
        elapsed = time.perf_counter() - started
    finally:
        torch.set_num_threads(before)
    return Matmul(device=device, dtype=dtype, threads=threads, shape=(m, k, n), flops=2 * m * k * n * count / elapsed,
                  seconds=round(elapsed, 3), load_1m=round(os.getloadavg()[0], 2), run=run)


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


class RunReferences:
    """One run's ``rates.json`` in its workdir: the matmul speeds measured in this run (each measured once, when a
    stage first needs it) and what each stage that ran recorded. ``start`` replaces whatever an earlier run left;
    a file of another run is never read (``read`` returns nothing of it)."""

    def __init__(self, workdir: str | Path, run: str):
        self.path, self.run = Path(workdir) / FILE, run

    @classmethod
    def start(cls, workdir: str | Path) -> RunReferences:
        refs = cls(workdir, new_run_id())
        refs._write({"run": refs.run, "matmul": {}, "stages": {}})
        return refs

    def read(self) -> dict[str, Any]:
        """This run's file ({} matmul and stages when it holds another run's, or is missing)."""
        data = json.loads(self.path.read_text()) if self.path.is_file() else {}
        if data.get("run") != self.run:
            return {"run": self.run, "matmul": {}, "stages": {}}
        return data

    def _write(self, data: dict[str, Any]) -> None:
        files.write_text(self.path, json.dumps(data, indent=2) + "\n")

    def matmul(self, device: str, dtype: str, threads: int, shape: tuple[int, int, int] | None = None,
               **measure: Any) -> Matmul:
        """This run's measurement at (device, dtype, threads, shape): measured now if this run has none yet."""
        data = self.read()
        if (found := data["matmul"].get(reference_key(device, dtype, threads, shape))) is not None:
            return Matmul(**{**found, "shape": tuple(found["shape"])})
        measured = measure_matmul(device, dtype, threads, run=self.run, shape=shape, **measure)
        data["matmul"][measured.key] = asdict(measured)
        self._write(data)
        return measured

    def record_stage(self, name: str, entry: dict[str, Any]) -> None:
        data = self.read()
        data["stages"][name] = entry
        self._write(data)


def matmul_parameters(model_dir: str | Path) -> int:
    """The parameters of ``model_dir``'s safetensors that cost a multiply-add per token: every 2-D weight but a token
    embedding (a lookup), which counts once as the output head when no separate head is stored (tied)."""
    from safetensors import safe_open

    counts = {"matmul": 0, "embedding": 0, "head": 0}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2:
                    part = "embedding" if "embed" in name else "head" if "lm_head" in name else "matmul"
                    counts[part] += shape[0] * shape[1]
    return counts["matmul"] + (counts["head"] or counts["embedding"])


def forward_flops(parameters: int) -> float:
    """FLOPs of one token's forward: a multiply-add per matmul parameter."""
    return 2.0 * parameters


def train_flops(parameters: int, substeps: float) -> float:
    """FLOPs of one trained position: forward (2) and backward (4) per matmul parameter, per unrolled sub-step."""
    return 6.0 * parameters * substeps


@dataclass(frozen=True, kw_only=True, slots=True)
class StageRate:
    """A stage's tokens over its wall time, beside the limit its FLOPs per token set on the measured matmul."""

    tokens: int
    wall_s: float
    flops_per_token: float
    flops: float  # the matmul FLOP/s measured in this run
    how: str  # one line: what the FLOPs per token count, and the matmul they are held against
    load_1m: float | None  # the mean 1-minute load average during the stage

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def limit_tokens_per_s(self) -> float:
        return self.flops / self.flops_per_token

    @property
    def ratio(self) -> float:
        return self.tokens_per_s / self.limit_tokens_per_s


def limit_line(counted: str, reference: Matmul) -> str:
    """How a limit was computed: ``counted`` (the FLOPs per token in words) at the measured matmul."""
    where = "GPU" if reference.device == "cuda" else f"{reference.threads} thread" + "s" * (reference.threads > 1)
    return (f"{counted} at {reference.flops / 1e9:.1f} GFLOP/s ({reference.dtype} {reference.shape[0]}x"
            f"{reference.shape[1]}x{reference.shape[2]} matmul, {where}, measured in this run at load "
            f"{reference.load_1m:.1f})")


def stage_rate(entry: dict[str, Any], references: dict[str, Any], wall_s: float) -> StageRate | None:
    """A stage's rate from its ``rates.json`` entry (tokens, FLOPs per token, what they count, the reference's key,
    the load) and this run's ``references`` (``matmul``); None when the entry has no tokens or its reference was
    not measured in this run."""
    found = references.get(entry.get("reference", ""))
    if not entry.get("tokens") or found is None:
        return None
    reference = Matmul(**{**found, "shape": tuple(found["shape"])})
    return StageRate(tokens=int(entry["tokens"]), wall_s=wall_s, flops_per_token=float(entry["flops_per_token"]),
                     flops=reference.flops, how=limit_line(entry["counted"], reference), load_1m=entry.get("load_1m"))
