"""The head-loss line's resume command (``pipelines/head.py``); the loss itself: tests/faults/test_head_loss.py."""

from __future__ import annotations

from pipelines.head import rerun_command


def test_the_resume_command_is_this_specdraft_command_line_else_said_in_words():
    assert rerun_command(["/venv/bin/specdraft", "run", "--config", "my night.yaml", "ray.address=h:6379"]) == (
        "specdraft run --config 'my night.yaml' ray.address=h:6379")
    assert rerun_command(["/src/flows/cli.py", "run", "--config", "c.yaml"]) == "specdraft run --config c.yaml"
    assert rerun_command(["/src/other/cli.py", "run"]) == "the same command"  # not ours
    assert rerun_command(["-c", "run"]) == rerun_command([]) == "the same command"
