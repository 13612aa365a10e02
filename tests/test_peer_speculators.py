"""The peer arm's converter (``benchmarks/peer_speculators.py``, issue 32 item 4): our EAGLE-3 feature store in
speculators' offline-training format — one ``hs_{i}.safetensors`` per sequence holding exactly the store's token
ids, aux states and last state, the training split first — and, where speculators' environment exists, read
back by speculators' own dataset as the same tensors (skipped without it: CI has no speculators)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch


@pytest.fixture(scope="module")
def toy_store(shipped_toy_target, tmp_path_factory):
    from benchmarks.toy_data import build_store

    store = tmp_path_factory.mktemp("peer-store") / "store"
    build_store(store, shipped_toy_target, 24, 1000, 64, 10, 24, [0, 1, 2])  # the EAGLE-3 features
    return store


def test_hidden_state_files_hold_the_store(toy_store, tmp_path):
    from safetensors.torch import load_file

    from benchmarks.peer_speculators import write_hidden_states
    from specdraft.store import FeatureDataset
    from specdraft.configs.reader import ReaderConfig

    out = write_hidden_states(toy_store, tmp_path, 0.2)
    rows, sizes = out["rows"], out["sizes"]
    assert out["aux_layers"] == [0, 1, 2] and sizes["train"] > 0 and sizes["val"] > 0
    assert len(rows["seq_len"]) == sizes["train"] + sizes["val"] == len(list((tmp_path / "hidden_states").iterdir()))
    freq = {}
    for n, split in enumerate(["train"] * sizes["train"] + ["val"] * sizes["val"]):
        i = n if split == "train" else n - sizes["train"]
        b = FeatureDataset([toy_store], ReaderConfig(val_fraction=0.2, prefetch=0), split=split,
                           aux_layers=[0, 1, 2]).load([i])
        hs = load_file(str(tmp_path / "hidden_states" / f"hs_{n}.safetensors"))
        t, d = b.input_ids.shape[1], b.hidden.shape[-1]
        assert hs["hidden_states"].shape == (t, 4, d) and torch.equal(hs["token_ids"], b.input_ids[0])
        assert torch.equal(hs["hidden_states"][:, :3].float().reshape(t, 3 * d), b.aux_hidden[0])  # fp16 as stored
        assert torch.equal(hs["hidden_states"][:, 3].float(), b.hidden[0])
        assert rows["input_ids"][n] == b.input_ids[0].tolist() and rows["seq_len"][n] == t
        assert rows["loss_mask"][n] == b.loss_mask[0].long().tolist()
        if split == "train":  # the assistant (loss-masked) tokens, as speculators counts them
            for tok in b.input_ids[0][b.loss_mask[0]].tolist():
                freq[tok] = freq.get(tok, 0) + 1
    assert dict(out["token_freq"]) == freq


def test_speculators_reads_the_converted_store(toy_store, tmp_path):
    from benchmarks.peer_speculators import VENV
    from benchmarks.real_model import ROOT

    python = VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no speculators environment at {VENV}")
    script = f"""
import json, torch
from pathlib import Path
from benchmarks.peer_speculators import convert_store
from speculators.train.data import ArrowDataset
out = Path({str(tmp_path)!r})
info = convert_store(Path({str(toy_store)!r}), out, 0.2)
train = ArrowDataset(max_len=512, datapath=out, train_ratio=info["train_data_ratio"], split="train",
                     on_missing="raise", hidden_states_dtype=torch.float32)
val = ArrowDataset(max_len=512, datapath=out, train_ratio=info["train_data_ratio"], split="val",
                   on_missing="raise", hidden_states_dtype=torch.float32)
first = train[0]
print(json.dumps({{"train": len(train), "val": len(val), "info": info,
                   "shapes": {{k: list(v.shape) for k, v in first.items()}}}}))
"""
    proc = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0 and "No module named 'speculators'" in proc.stderr:
        pytest.skip(f"speculators is not installed in {VENV}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    info = got["info"]
    assert (got["train"], got["val"]) == (info["train_sequences"], info["val_sequences"])  # our split, reproduced
    t, d = got["shapes"]["input_ids"][0], info["d"]
    assert got["shapes"]["hidden_states"] == [t, 3 * d] and got["shapes"]["verifier_last_hidden_states"] == [t, d]
    assert got["shapes"]["loss_mask"] == [t]
