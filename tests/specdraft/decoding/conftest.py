"""Fixtures for the decoding tests: a tiny toy target directory (built once per session)."""

from __future__ import annotations

import pytest
import torch

from specdraft.toy.build import build_toy_target
from specdraft.configs.toy import ToyTargetConfig

SMALL_TOY = ToyTargetConfig(
    num_conversations=300,
    vocab_size=300,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    max_seq_len=128,
    train_steps=10,
    batch_size=8,
    num_eval_conversations=16,
    num_threads=1,
)


@pytest.fixture(scope="session")
def toy_target_dir(tmp_path_factory):
    return build_toy_target(tmp_path_factory.mktemp("toy") / "target", SMALL_TOY, progress=False)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are overhead-bound: one intra-op thread is faster and immune to a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
