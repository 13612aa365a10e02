"""The local (ephemeral) Prefect API a ``specdraft run`` starts when no server is configured.

docs/first-run.md "What the first run does": the toy run must work on a fresh, loaded 2-core machine. Prefect
starts its ephemeral API as a uvicorn subprocess and waits ``server.ephemeral.startup_timeout_seconds``
(20 s by default) for it; the first start migrates a new SQLite database, which on such a machine
takes longer, and a database shared through ``~/.prefect`` can be locked by another run. So, unless
``PREFECT_API_URL`` points at a server, ``local_prefect_api(workdir)``:

* waits up to ``STARTUP_TIMEOUT_S`` for the server to come up,
* keeps the ephemeral API's database in the run's workdir (``<workdir>/prefect.db``) unless a
  Prefect home or database was chosen, so runs in different workdirs never share (or lock) one
  database,
* turns off the server's telemetry heartbeat (a background job that fails on a locked database),

each only where the user has not set it (environment or active Prefect profile), and on the way out
drains Prefect's log and event workers and stops the server while the output streams are still
open: the ``atexit`` stop would otherwise log to a closed stream ("--- Logging error ---").

Prefect is imported lazily so the CLI's ``--help`` stays instant.
"""

from __future__ import annotations

import atexit
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 300  # seconds the ephemeral API gets to start (Prefect's default: 20)
DATABASE_FILE = "prefect.db"


def local_api_settings(workdir: str | Path) -> dict[Any, Any]:
    """The Prefect settings (``Setting`` -> value) ``local_prefect_api`` applies for ``workdir``:
    empty when an API URL is configured; never one the user set."""
    import prefect.settings as ps

    current = ps.get_current_settings()
    if current.api.url:
        return {}
    updates: dict[Any, Any] = {}
    if "startup_timeout_seconds" not in current.server.ephemeral.model_fields_set:
        updates[ps.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS] = STARTUP_TIMEOUT_S
    chosen = "home" in current.model_fields_set or "connection_url" in current.server.database.model_fields_set
    if not chosen:
        database = Path(workdir).absolute() / DATABASE_FILE
        updates[ps.PREFECT_SERVER_DATABASE_CONNECTION_URL] = f"sqlite+aiosqlite:///{database}"
    if "analytics_enabled" not in current.server.model_fields_set:
        updates[ps.PREFECT_SERVER_ANALYTICS_ENABLED] = False
    return updates


@contextmanager
def local_prefect_api(workdir: str | Path) -> Iterator[dict[Any, Any]]:
    """Run flows inside this block against a reliably started ephemeral API, stopped at the end.

    Yields the settings applied (empty with ``PREFECT_API_URL`` set: the server is the user's).
    """
    import prefect.settings as ps

    if ps.get_current_settings().api.url:
        yield {}
        return
    updates = local_api_settings(workdir)
    if ps.PREFECT_SERVER_DATABASE_CONNECTION_URL in updates:
        Path(workdir).absolute().mkdir(parents=True, exist_ok=True)
    with ps.temporary_settings(updates=updates):
        try:
            yield updates
        finally:
            stop_ephemeral_api()


def stop_ephemeral_api() -> None:
    """Drain Prefect's API log and event workers, then stop the ephemeral server if one runs."""
    server_module = sys.modules.get("prefect.server.api.server")  # not imported: no server started
    server = server_module.SubprocessASGIServer._instances.get(None) if server_module else None
    if server is None or not server.running:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:  # the worker never started
            pass
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())
    server.stop()
    atexit.unregister(server.stop)
