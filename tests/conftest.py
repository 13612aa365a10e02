"""Session-wide fixtures: one tiny toy target and one local Ray for the whole run; the ephemeral
Prefect API set up as ``specdraft run`` sets it up (``flows/local_api.py``) and stopped at the end.

The README's test command runs the suite on two pytest-xdist workers (``-n 2``): each worker is its own
session, with its own Prefect home (database), Ray cluster, S3 server (free port) and temp dirs, and
its share of the cores for torch; the tests run longest first (``pytest_collection_modifyitems``).

A module's tests run on one worker (``--dist loadfile``): its module-scoped fixtures (the docs test's one
session, a module's dumps and trained drafts) are built once. Not ``--dist loadgroup`` with ``xdist_group``
marks: pytest-xdist 3.8 groups by a suffix it writes into ``item._nodeid``, which pytest 9 no longer reads
(``Node.nodeid`` is ``str(item._id)``), so the groups were silently spread over both workers — the docs test's
chain then ran on both, each worker replaying what the other had run (``tests/test_readme.py::test_the_test_command_keeps_a_module_on_one_worker`` runs the README command's
scheduling on two small modules)."""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path

from flows.local_api import STARTUP_TIMEOUT_S

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... on an xdist worker, else None
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))

# Isolate Prefect's local state (ephemeral API database) and keep it quiet, before prefect is imported;
# a loaded CI machine needs more than Prefect's 20 s to start the API on a new database. The workers
# inherit the controller's environment: a home this file made there is replaced by one per worker (two
# ephemeral APIs on one SQLite database lock it); a home the user set is kept.
_OWN_HOME = "SPECDRAFT_TESTS_PREFECT_HOME"
_MADE_HOME = None  # the home this process made (removed at the session's end)
if "PREFECT_HOME" not in os.environ or os.environ.get(_OWN_HOME) == os.environ["PREFECT_HOME"]:
    _MADE_HOME = tempfile.mkdtemp(prefix=f"specdraft-prefect-{WORKER or ''}")
    os.environ["PREFECT_HOME"] = os.environ[_OWN_HOME] = _MADE_HOME
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(STARTUP_TIMEOUT_S))
os.environ.setdefault("DO_NOT_TRACK", "1")
# each xdist worker its share of the cores, for torch here and in the processes it starts (CLI
# subprocesses, a Prefect worker's flow run): two workers each spinning two OpenMP threads on two cores
# slow each other down
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))

import pytest


DURATIONS = Path(__file__).with_name("durations.json")  # seconds per test module, as last measured


def recorded_seconds() -> dict[str, float]:
    """``tests/durations.json``'s seconds per module path (relative to the checkout); {} without the file."""
    if not DURATIONS.is_file():
        return {}
    return {name: float(s) for name, s in json.loads(DURATIONS.read_text()).items() if not name.startswith("_")}


def pytest_configure(config: pytest.Config) -> None:
    # xdist hands modules out in collection order (``--dist loadfile``) unless it reorders them by their number of
    # tests: a one-test module of three minutes then came last and ran while the other worker sat idle
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The end-to-end (``slow``) modules first, longest first by their measured seconds (``tests/durations.json``),
    so that the last module on one worker does not start while the other is idle; then the other modules, those of
    most tests first (xdist's own order, measured 267-268 s for the fast run against 284-287 s by seconds: its
    Ray-heavy modules then started together). Stable, and by module (a module's tests stay together: its
    module-scoped fixtures are built once per worker)."""
    seconds = recorded_seconds()
    root = config.rootpath
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    counts = Counter(item.path for item in items)

    def weight(item: pytest.Item) -> tuple[int, float]:
        if item.path in slow_files:
            name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
            return (0, -seconds.get(name, 0.0))
        return (1, -counts[item.path])

    items.sort(key=weight)


@pytest.fixture(scope="session", autouse=True)
def stop_prefect_api_at_the_end():
    """Stop an ephemeral Prefect API a test started while pytest's streams are open (its atexit
    stop would log to a closed stream: "--- Logging error --- ValueError: I/O operation on closed file")."""
    yield
    from flows.local_api import stop_ephemeral_api

    stop_ephemeral_api()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The temporary Prefect home this process made is not left in /tmp (the xdist controller's too, which
    runs no test; a worker's API is stopped by then)."""
    if _MADE_HOME:
        import shutil

        shutil.rmtree(_MADE_HOME, ignore_errors=True)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def built_once(tmp_path_factory, name: str, build, leaf: str = "target") -> Path:
    """``build(out)`` run once per test run, not once per xdist worker: the workers share the run's
    base temp directory, and the first to take the lock builds ``name`` there (the toy build writes a
    temp directory and moves it into place, so a finished directory is a complete one); ``out`` is
    ``shared-<name>/<leaf>``."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    root = root.parent if WORKER else root  # xdist: <run>/popen-gw0 -> <run>, shared by the workers
    out = root / f"shared-{name}" / leaf
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.is_dir():
            out.parent.mkdir(exist_ok=True)
            build(out)
    return out


@pytest.fixture(scope="session")
def tiny_toy_target(tmp_path_factory) -> Path:
    """A toy target small enough to build in seconds (same recipe as the default, scaled down)."""
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig

    cfg = ToyTargetConfig(
        num_conversations=800, vocab_size=320, hidden_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, intermediate_size=128, max_seq_len=128, train_steps=120, batch_size=16,
        lr=1e-2, warmup_steps=5, num_eval_conversations=32,
    )
    return built_once(tmp_path_factory, "tiny-toy", lambda out: build_toy_target(out, cfg, progress=False))


@pytest.fixture(scope="session")
def deep_toy_target(tmp_path_factory) -> Path:
    """A 7-layer toy target (about 1 s to build, barely trained): deep enough for ``aux_layers=eagle3``
    (the states entering layers 2, N/2 = 3 and N-3 = 4) — the EAGLE-3 recipes' default."""
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig

    cfg = ToyTargetConfig(
        num_conversations=200, vocab_size=320, hidden_size=64, num_layers=7, num_heads=2, num_kv_heads=1,
        intermediate_size=128, max_seq_len=128, train_steps=20, batch_size=8, lr=1e-2, warmup_steps=2,
        num_eval_conversations=8,
    )
    return built_once(tmp_path_factory, "deep-toy", lambda out: build_toy_target(out, cfg, progress=False))


@pytest.fixture(scope="session")
def shipped_toy_target(tmp_path_factory) -> Path:
    """The toy target ``specdraft run --config configs/toy.yaml`` uses (the default config: the shipped
    prebuilt build, copied; 3 layers, so its EAGLE-3 features are the states entering layers 0, 1, 2)."""
    from specdraft.toy.build import build_toy_target
    from specdraft.configs.toy import ToyTargetConfig

    return built_once(tmp_path_factory, "shipped-toy",
                      lambda out: build_toy_target(out, ToyTargetConfig(), progress=False, prebuilt=True))


TOY_DRAFT_AUX = [0, 1, 2]  # the shipped toy target's states entering each layer (the EAGLE-3 recipes' features)


@pytest.fixture(scope="session")
def toy_drafts(shipped_toy_target, tmp_path_factory):
    """``toy_drafts(recipe, vocab=None)``: a draft of the shipped toy target trained briefly with ``recipe``
    (in-memory features of 320 toy conversations, the recipe's own stages through ``build_run``; DFlash with 2
    layers, blocks of 8 and 64 anchors per sequence, to stay cheap; ``vocab``: ``train.draft_vocab_size``, the
    draft vocabulary of an EAGLE-3 recipe, None the default), trained once per test run — the first worker to
    ask for a recipe trains it, the others wait for it (``built_once``). Each recipe takes about a minute
    on 2 cores; the features are computed once per worker, when the first draft it trains needs them."""
    samples: list = []

    def features() -> tuple[list, list]:
        if not samples:
            import random

            from specdraft.features import compute_features
            from specdraft.targets.loading import load_target_model, load_tokenizer
            from specdraft.toy.conversations import generate_conversations

            model, tokenizer = load_target_model(shipped_toy_target), load_tokenizer(shipped_toy_target)
            samples.extend(compute_features(model, tokenizer, generate_conversations(320, seed=1000), 160, 10,
                                            progress=False, aux_layers=TOY_DRAFT_AUX))
            random.Random(0).shuffle(samples)
        return samples[32:], samples[:32]  # train, held out

    def train(recipe: str, vocab: int | None, out: Path) -> None:
        import math
        import shutil
        from dataclasses import replace

        from specdraft.models import save_draft
        from specdraft.quickstart import train_on_samples
        from specdraft.configs.train import OptimConfig, TrainConfig
        from specdraft.configs.recipes import RECIPES

        stages = len(RECIPES[recipe].stages)
        block = {}
        if recipe == "dflash":  # DFlash Eq. 4: gamma = 4 for blocks of 8
            stage = replace(RECIPES[recipe].stages[0], anchors=64, step_decay=math.exp(-1 / 4))
            block = dict(draft_layers=2, block_size=8, stages=[stage])
        if vocab is not None:
            block["draft_vocab_size"] = vocab
        cfg = TrainConfig(recipe=recipe, epochs=max(3, stages), min_steps=0, seed=0,  # the total, split over the stages
                          optim=OptimConfig(lr=2e-3, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1), **block)
        trained = train_on_samples(shipped_toy_target, cfg, *features(), aux_layers=TOY_DRAFT_AUX)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_draft(trained.run.draft, partial)
        partial.rename(out)  # a draft directory that exists is a complete one

    def draft(recipe: str, vocab: int | None = None) -> Path:
        name = f"toy-draft-{recipe}" + (f"-v{vocab}" if vocab else "")
        return built_once(tmp_path_factory, name, lambda out: train(recipe, vocab, out), "draft")

    return draft


@pytest.fixture(scope="session")
def prebuilt() -> Path:
    """The toy target the package ships, read in place (tests that only read it)."""
    from specdraft.toy.build import PREBUILT_DIR

    if not (PREBUILT_DIR / "model.safetensors").is_file():
        pytest.skip("the shipped toy target is not in this checkout")
    return PREBUILT_DIR


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


def worker_pythonpath() -> str:
    """PYTHONPATH for Ray workers: this tree first (the editable install may point at another)."""
    root = Path(__file__).resolve().parents[1]
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="session")
def local_ray(request):
    """The local Ray of every test that needs one, started once per session by ``connect_ray`` (its worker
    setup hook points the state API at this cluster: an xdist worker's cluster is never alone on the
    machine). Its workers see the local S3 server's endpoint and (dummy) credentials, as every node of a
    real cluster must (``s3_ray``): the tests on S3 need no second cluster."""
    import ray

    connect_local_ray(request)
    yield ray
    ray.shutdown()


def connect_local_ray(request) -> None:
    """Connect ``local_ray``'s cluster (again, after a test module ran its own: ``tests/ray_nodes.py``)."""
    from pipelines.cluster import connect_ray

    try:
        s3 = s3_variables(request.getfixturevalue("s3_server"))
    except pytest.skip.Exception:  # no s3fs / moto: no S3 tests either
        s3 = {}
    connect_ray(num_cpus=2, env_vars={"PYTHONPATH": worker_pythonpath(), **s3}, log_to_driver=False)


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


def s3_variables(endpoint: str) -> dict[str, str]:
    """The standard AWS variables pointing at the local server (dummy credentials)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture()
def s3_env(s3_server, monkeypatch) -> dict[str, str]:
    """Point the standard AWS variables at the local server (dummy credentials); returns them (for Ray)."""
    env = s3_variables(s3_server)
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
def s3_ray(local_ray, s3_env) -> dict[str, str]:
    """Ray whose workers see the endpoint and (dummy) credentials, as every node of a real cluster must:
    the session's cluster (``local_ray`` starts it with them); returns them."""
    workers = local_ray.get_runtime_context().runtime_env.get("env_vars", {})  # what every worker of the job sees
    assert {k: workers.get(k) for k in s3_env} == s3_env, f"the session's Ray workers see {workers}, not the local S3 server"
    return s3_env
