"""A stage's third-party lines (``pipelines.stage_log``): Ray Data's INFO records and the known warnings go to the
stage's log file, named in one line; its warnings, other loggers and other warnings still reach the console."""

from __future__ import annotations

import io
import logging
import warnings

from pipelines.stage_log import stage_log


def test_third_party_lines_go_to_the_stage_log_and_the_rest_stays(tmp_path, monkeypatch):
    import ray.data  # noqa: F401  (Ray Data's logging: its console handler on "ray.data", INFO and up)

    data = logging.getLogger("ray.data")
    console = io.StringIO()
    shown_by = [h for h in data.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                and not type(h).__module__.startswith("_pytest")]  # pytest's capture handler, left there by an earlier test
    assert shown_by  # Ray Data's console handler(s)
    for handler in shown_by:
        monkeypatch.setattr(handler, "stream", console)  # what Ray Data prints, read here
    shown: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda m, *a, **k: shown.append(str(m)))
    said: list[str] = []
    log = tmp_path / "logs" / "features.log"
    with stage_log(log, said.append), warnings.catch_warnings():
        warnings.simplefilter("always")
        logging.getLogger("ray.data._internal.execution.streaming_executor").info(
            "Starting execution of Dataset dataset_1")  # a child logger's record, at ray.data's handler
        data.info("Execution plan of Dataset dataset_1")
        data.warning("Ray Data ran out of memory")  # a warning: the user can act on it
        warnings.warn("`ray_remote_args` is deprecated and will be removed in Ray 2.64.", DeprecationWarning)
        warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
        warnings.warn("the draft has no chat template", UserWarning)  # ours: shown
    after = "Starting execution of Dataset dataset_2"
    data.info(after)  # the stage is over: the console again
    warnings.warn("reduce_op again", FutureWarning)
    kept = log.read_text()
    assert "Starting execution of Dataset dataset_1" in kept and "Execution plan of Dataset dataset_1" in kept
    assert "ray_remote_args" in kept and "reduce_op is deprecated" in kept
    assert "out of memory" not in kept and "chat template" not in kept and after not in kept
    # (each console handler of ray.data prints it: one line per handler, the same line)
    printed = [line.split(" -- ")[-1] for line in console.getvalue().splitlines()]
    assert list(dict.fromkeys(printed)) == ["Ray Data ran out of memory", after]
    assert shown == ["the draft has no chat template", "reduce_op again"]
    assert said == [f"[specdraft] third-party log lines of this stage (Ray Data, known warnings) go to {log}"]


def test_the_stage_log_is_named_once_even_when_saying_it_comes_back_as_a_record(tmp_path):
    """The flow's ``print`` is captured as a log record that can reach Ray Data's handler again (each stage of the
    flow named its log 76 times, until the recursion limit): the line that names the file is said once."""
    import ray.data  # noqa: F401

    data = logging.getLogger("ray.data")
    said: list[str] = []

    def say(line: str) -> None:  # as a captured print: the line logged again, through ray.data
        said.append(line)
        data.info(line)

    log = tmp_path / "features.log"
    with stage_log(log, say):
        data.info("Starting execution of Dataset dataset_1")
        data.info("Execution plan of Dataset dataset_1")
    assert said == [f"[specdraft] third-party log lines of this stage (Ray Data, known warnings) go to {log}"]
    assert "Starting execution of Dataset dataset_1" in log.read_text()
