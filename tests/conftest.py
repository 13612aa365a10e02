"""Session-wide fixtures: one tiny toy target and one local Ray for the whole run; the ephemeral
Prefect API set up as ``specdraft run`` sets it up (``flows/local_api.py``) and stopped at the end."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from flows.local_api import STARTUP_TIMEOUT_S

# Isolate Prefect's local state (ephemeral API database) and keep it quiet, before prefect is imported;
# a loaded CI machine needs more than Prefect's 20 s to start the API on a new database.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="specdraft-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(STARTUP_TIMEOUT_S))
os.environ.setdefault("DO_NOT_TRACK", "1")

import pytest


@pytest.fixture(scope="session", autouse=True)
def stop_prefect_api_at_the_end():
    """Stop an ephemeral Prefect API a test started while pytest's streams are open (its atexit
    stop would log to a closed stream: "--- Logging error --- ValueError: I/O operation on closed file")."""
    yield
    from flows.local_api import stop_ephemeral_api

    stop_ephemeral_api()

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def tiny_toy_target(tmp_path_factory) -> Path:
    """A toy target small enough to build in seconds (same recipe as the default, scaled down)."""
    from specdraft.toy.build import ToyTargetConfig, build_toy_target

    cfg = ToyTargetConfig(
        num_conversations=800, vocab_size=320, hidden_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, intermediate_size=128, max_seq_len=128, train_steps=120, batch_size=16,
        lr=1e-2, warmup_steps=5, num_eval_conversations=32,
    )
    return build_toy_target(tmp_path_factory.mktemp("toy") / "target", cfg, progress=False)


@pytest.fixture(scope="session")
def templateless_target(tiny_toy_target, tmp_path_factory) -> Path:
    """The tiny toy target as a base model would ship it: no chat template."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("templateless") / "target"
    shutil.copytree(tiny_toy_target, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def local_ray():
    import ray

    from pipelines.cluster import connect_ray

    connect_ray(num_cpus=2, log_to_driver=False)
    yield ray
    ray.shutdown()
