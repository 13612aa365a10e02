"""The Ray head lost mid-run (issue 43 item 3): the driver ends with one line naming the head's address and the
command that resumes the run, a non-zero status, no traceback (``pipelines/head.py``) — not Ray's own ending (its
lines about ``gcs_server.out``, once its wait for the head is over). The driver here is a process of its own
connected with ``connect_ray`` to a one-node cluster (``tests/ray_nodes.py``) and waiting on a task when the head
is killed; Ray's wait for a lost head is set to 5 s (``RAY_gcs_rpc_server_reconnect_timeout_s``, as a user sets
it), so the line comes after 5 s, where Ray's default is 60."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pipelines.head import EXIT_HEAD_LOST, RECONNECT_ENV
from tests.conftest import worker_pythonpath
from tests.ray_nodes import ray_nodes

pytestmark = pytest.mark.slow

DRIVER = """
import sys, time
import ray
from pipelines.cluster import connect_ray

connect_ray(sys.argv[1])


@ray.remote(num_cpus=0)
def stage():
    time.sleep(600)


print("running", flush=True)
ray.get(stage.remote())
"""


def test_the_heads_loss_is_one_line_naming_it_and_the_resume_command(tmp_path):
    with ray_nodes(tmp_path / "nodes", workers=0, cpus=1, connect=False) as up:
        env = {**os.environ, "PYTHONPATH": worker_pythonpath(), RECONNECT_ENV: "5"}  # the nodes' loopback setting too
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, up["address"]], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert driver.stdout.readline() == "running\n", driver.stderr.read()
            time.sleep(1)  # the task started on the head
            lost = time.monotonic()
            up["cluster"].remove_node(up["cluster"].head_node, allow_graceful=False)  # its GCS and raylet killed
            _, err = driver.communicate(timeout=120)
        finally:
            driver.kill()
        took = time.monotonic() - lost
    lines = err.strip().splitlines()
    print(f"the driver ended {took:.1f} s after the head; its stderr:\n{err}")
    assert driver.returncode == EXIT_HEAD_LOST != 0
    assert lines[-1] == (f"specdraft: lost the Ray head at {up['address']} (nothing has answered there for 5 s): the "
                         "run stopped — start the cluster's head again (or point ray.address / RAY_ADDRESS at a "
                         "running one), then resume with: the same command")
    assert "Traceback" not in err and "gcs_server.out" not in err  # not Ray's ending: ours came first
    assert 5 <= took < 5 + 30, took  # our wait (Ray's), before Ray's own (moved 30 s later)
