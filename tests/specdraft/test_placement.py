"""Tests for specdraft.placement: device / dtype / kernel resolution and the GPU spread plan.

No GPU here: the CUDA branches are checked as plans (what would be passed to
``from_pretrained``), never run; ``flash_attn`` is not installed, so its "importable" case is
simulated by patching ``importlib.util.find_spec`` (said in that test).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from specdraft import placement
from specdraft.config import ConfigError
from specdraft.configs.devices import spread_gpus


def test_resolve_dtype():
    assert placement.resolve_dtype("auto", "cpu") is torch.float32
    assert placement.resolve_dtype("auto", "cuda") is torch.bfloat16  # a device name: no GPU needed
    assert placement.resolve_dtype("auto", torch.device("cuda", 3)) is torch.bfloat16
    assert placement.resolve_dtype("float16", "cuda") is torch.float16
    assert placement.resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert placement.resolve_dtype("float32") is torch.float32
    assert placement.resolve_dtype(torch.float16, "cpu") is torch.float16  # a dtype passes through
    with pytest.raises(ConfigError, match="dtype must be"):
        placement.resolve_dtype("float64", "cpu")


def test_resolve_device():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert placement.resolve_device("auto").type == expected
    assert placement.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert placement.resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="device must be"):
        placement.resolve_device("meta")


def test_resolve_attn_implementation(monkeypatch):
    assert placement.resolve_attn_implementation("sdpa", "cpu") == "sdpa"
    assert placement.resolve_attn_implementation("eager", "cuda") == "eager"
    with pytest.warns(UserWarning, match="flash-attn"):
        assert placement.resolve_attn_implementation("flash_attention_2", "cpu") == "sdpa"
    with pytest.raises(ConfigError, match="attn_implementation must be"):
        placement.resolve_attn_implementation("flex", "cpu")
    # flash-attn is not installed here: pretend it is importable (only find_spec is patched)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real(name, *a))
    assert placement.resolve_attn_implementation("flash_attention_2", "cuda") == "flash_attention_2"
    with pytest.warns(UserWarning):
        assert placement.resolve_attn_implementation("flash_attention_2", "cpu") == "sdpa"  # CUDA only


@pytest.mark.parametrize("num_gpus,spread", [(0.25, 1), (0.5, 1), (1, 1), (1.0, 1), (2.0, 2), (4, 4), (8.0, 8)])
def test_spread_gpus(num_gpus, spread):
    assert spread_gpus(num_gpus) == spread


@pytest.mark.parametrize("num_gpus", [0, -1, 1.5, 2.25])
def test_spread_gpus_rejects(num_gpus):
    with pytest.raises(ConfigError, match="fraction <= 1"):
        spread_gpus(num_gpus)


def test_device_map_for_one_device():
    for device in (torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 2)):
        assert placement.device_map_for(device) == ({"": device}, None)


def test_device_map_for_spread_plan():
    """The plan for an actor holding 4 GPUs: transformers' balanced split over GPUs 0..3, with a
    max_memory naming only those GPUs (no CPU, no other GPU). Not loaded: no GPU here."""
    memory = {i: 80 << 30 for i in range(4)}
    device_map, max_memory = placement.device_map_for(torch.device("cuda"), 4, memory)
    assert device_map == "auto"
    assert max_memory == memory and "cpu" not in max_memory and "disk" not in max_memory
    with pytest.raises(AssertionError, match="device must be 'auto' or 'cuda'"):
        placement.device_map_for(torch.device("cpu"), 2, {0: 1, 1: 1})
    with pytest.raises(AssertionError, match="device must be 'auto' or 'cuda'"):
        placement.device_map_for(torch.device("cuda", 1), 2, {0: 1, 1: 1})
    with pytest.raises(AssertionError, match="gpu_memory must name GPUs 0..3"):
        placement.device_map_for(torch.device("cuda"), 4, {0: 1, 1: 1})


def test_check_spread():
    placement.check_spread({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": 1}, 2)
    placement.check_spread({"model.embed_tokens": "cuda:0", "lm_head": torch.device("cuda", 1)}, 2)
    with pytest.raises(ValueError, match="does not fit on 2 GPUs.*disk"):
        placement.check_spread({"model.embed_tokens": 0, "model.layers.1": 1, "lm_head": "disk"}, 2)
    with pytest.raises(ValueError, match="does not fit on 2 GPUs.*cpu"):
        placement.check_spread({"model.embed_tokens": 0, "model.layers.1": "cpu"}, 2)
    with pytest.raises(ValueError, match="does not fit on 2 GPUs"):
        placement.check_spread({"model.embed_tokens": 0, "model.layers.1": 2}, 2)  # a GPU it does not hold


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPUs")
def test_free_gpu_memory_without_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="spread over 2 GPUs but this process sees 0"):
        placement.free_gpu_memory(2)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 3)


def test_input_output_device_and_description_of_plain_modules():
    module = _Plain()
    assert placement.input_device(module) == torch.device("cpu")
    assert placement.output_device(module) == torch.device("cpu")
    described = placement.describe_placement(module)
    assert described == {"attn_implementation": None, "dtype": "float32", "devices": ["cpu"],
                         "input_device": "cpu", "output_device": "cpu"}
