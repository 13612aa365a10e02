"""The ephemeral Prefect API of ``specdraft run``: a generous startup timeout and a per-workdir
database unless the user chose otherwise, and a server stopped before the interpreter exits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.local_api import STARTUP_TIMEOUT_S
from specdraft.toy.build import PREBUILT_DIR

ROOT = Path(__file__).resolve().parents[2]
SHOW = """
import json, sys
import prefect.settings as s
from flows.local_api import local_prefect_api
with local_prefect_api(sys.argv[1]) as applied:
    db = s.PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    print(json.dumps({"applied": len(applied), "timeout": s.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(),
                      "db": getattr(db, "get_secret_value", lambda: db)(),
                      "analytics": s.PREFECT_SERVER_ANALYTICS_ENABLED.value()}))
"""


def fresh_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a first run: no Prefect settings (profiles read from an empty file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_PROFILES_PATH=str(tmp_path / "profiles.toml"), PYTHONPATH=str(ROOT), **extra)
    return env


def show(tmp_path: Path, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", SHOW, str(tmp_path / "work")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_first_run_settings(tmp_path):
    first = show(tmp_path, fresh_env(tmp_path))
    assert first == {"applied": 3, "timeout": STARTUP_TIMEOUT_S, "analytics": False,
                     "db": f"sqlite+aiosqlite:///{tmp_path / 'work' / 'prefect.db'}"}


def test_the_users_own_settings_and_server_win(tmp_path):
    import prefect.settings as ps

    from flows.local_api import local_api_settings, local_prefect_api

    # this process has them all set (tests/conftest.py: a Prefect home, the timeout, no analytics)
    assert os.environ["PREFECT_HOME"] and local_api_settings(tmp_path) == {}
    assert ps.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() == int(
        os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"])
    with ps.temporary_settings(updates={ps.PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with local_prefect_api(tmp_path / "work") as applied:  # a server of the user's: nothing to start
            assert applied == {}
    assert not (tmp_path / "work").exists()


@pytest.mark.slow
def test_cli_run_starts_the_api_in_the_workdir_and_exits_without_logging_errors(tmp_path):
    """A real ``specdraft run`` whose flow fails in a stage (the toy target with its tokenizer files emptied: they
    are there by name and its weights are its config's, so the pre-flight passes, but no stage can tokenize): the
    API starts (its database appears in the workdir), the flow fails, and the server is stopped before exit — no
    "--- Logging error ---" from an atexit stop on closed streams."""
    work, broken = tmp_path / "work", tmp_path / "broken-target"
    shutil.copytree(PREBUILT_DIR, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", "--config", "configs/toy.yaml", f"workdir={work}",
         f"target.path={broken}", "retries=0", "tracking.enabled=false"],
        env=fresh_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert out.returncode not in (0, 2) and "Flow run" in out.stderr, out.stderr[-3000:]
    assert (work / "prefect.db").is_file()
    for line in ("Timed out while attempting to connect", "--- Logging error ---", "I/O operation on closed file",
                 "database is locked"):
        assert line not in out.stderr, out.stderr[-3000:]
    assert "Stopping temporary server" in out.stderr  # stopped by specdraft, while stderr was open
