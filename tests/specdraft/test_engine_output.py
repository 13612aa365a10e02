"""The engine process's output (``specdraft.evaluation.engine.run_logged``): what the program prints — vLLM's
INFO lines, warnings — goes to the log file; the lines it writes to the progress descriptor reach the user."""

from __future__ import annotations

import io
import sys

CHILD = r"""
import logging, os, sys, warnings
logging.basicConfig(level=logging.INFO)
logging.getLogger("vllm.engine").info("Automatically detected platform cpu.")
warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
print("tcmalloc: large alloc 1073741824 bytes")
progress = os.fdopen(int(os.environ["SPECDRAFT_PROGRESS_FD"]), "w", buffering=1)
progress.write("[specdraft] engine vanilla 1/2 prompts tok/s 5 eta 1s\n")
progress.write("[specdraft] engine vanilla 2/2 prompts tok/s 5 eta 0s\n")
sys.exit(int(sys.argv[1]))
"""


def test_noise_goes_to_the_log_and_progress_to_the_user(tmp_path):
    from specdraft.evaluation.engine import run_logged

    log, relay = tmp_path / "eval" / "engine.log", io.StringIO()
    assert run_logged([sys.executable, "-c", CHILD, "0"], {}, log, 60, relay) == 0
    assert relay.getvalue().splitlines() == ["[specdraft] engine vanilla 1/2 prompts tok/s 5 eta 1s",
                                             "[specdraft] engine vanilla 2/2 prompts tok/s 5 eta 0s"]
    kept = log.read_text()
    for noise in ("Automatically detected platform cpu.", "reduce_op is deprecated", "tcmalloc: large alloc"):
        assert noise in kept and noise not in relay.getvalue()
    assert "[specdraft]" not in kept
    # the exit status comes back; a second run appends to the same log; no relay: the progress is dropped
    assert run_logged([sys.executable, "-c", CHILD, "3"], {}, log, 60, None) == 3
    assert log.read_text().count("tcmalloc: large alloc") == 2


def test_an_engine_past_its_time_is_killed_and_said(tmp_path):
    from specdraft.evaluation.engine import run_logged

    hang = "import time; print('loading', flush=True); time.sleep(60)"
    assert run_logged([sys.executable, "-c", hang], {}, tmp_path / "engine.log", 1.0, io.StringIO()) is None
    assert (tmp_path / "engine.log").read_text() == "loading\n"
