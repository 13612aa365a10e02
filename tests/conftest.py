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
# Ray Train's controller polls its workers every 2 s by default, and a worker's report() (every checkpoint
# and epoch end) waits for that poll: tiny test runs spent most of their time there
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

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
def deep_toy_target(tmp_path_factory) -> Path:
    """A 7-layer toy target (about 1 s to build, barely trained): deep enough for ``aux_layers=eagle3``
    (the states entering layers 2, N/2 = 3 and N-3 = 4) — the EAGLE-3 recipes' default."""
    from specdraft.toy.build import ToyTargetConfig, build_toy_target

    cfg = ToyTargetConfig(
        num_conversations=200, vocab_size=320, hidden_size=64, num_layers=7, num_heads=2, num_kv_heads=1,
        intermediate_size=128, max_seq_len=128, train_steps=20, batch_size=8, lr=1e-2, warmup_steps=2,
        num_eval_conversations=8,
    )
    return build_toy_target(tmp_path_factory.mktemp("deep-toy") / "target", cfg, progress=False)


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


# --- an S3-compatible object store on 127.0.0.1 (moto's server mode) ---------------------------


@pytest.fixture(scope="session")
def s3_server():
    """Endpoint URL of a real S3 HTTP server (moto) on a free local port, for the whole run."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """Point the standard AWS variables at the local server (dummy credentials); returns them (for Ray)."""
    env = {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    return env


@pytest.fixture()
def s3_bucket(s3_env) -> str:
    """A fresh, empty bucket on the local server: ``s3://<name>``."""
    import uuid

    import fsspec

    name = f"specdraft-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3").mkdir(name)
    return f"s3://{name}"


@pytest.fixture()
def s3_ray(s3_env) -> dict[str, str]:
    """Ray restarted so that its workers see the endpoint and (dummy) credentials, as every node of a
    real cluster must; left running for the tests after it."""
    import ray

    ray.shutdown()
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    from pipelines.cluster import connect_ray

    # the same setup hook as every other local cluster (known-harmless lines dropped in the workers)
    connect_ray(num_cpus=2, env_vars={"PYTHONPATH": path, **s3_env}, logging_level="WARNING", log_to_driver=False)
    return s3_env
