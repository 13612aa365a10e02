"""The dump's progress lines (issue 44 item 4: a long stage talks, as training does): ``pipelines.dump.ShardProgress``
polls the store for shards finished — a final shard directory whose record is written, what resume counts as done —
and prints ``specdraft.progress`` lines. Fake shards (a Zarr group with its record) in a tmp dir, a short interval."""

from __future__ import annotations

import io
import time

from pipelines.dump import ShardProgress
from specdraft import store
from specdraft.store import location
from specdraft.store.schema import SHARD_ATTR


def _finish(out, index: int, tokens: int) -> None:
    """Shard ``index`` complete as the writer leaves it: its group with the record written last."""
    location.open_group(out / store.shard_name(index), "w").attrs[SHARD_ATTR] = {"index": index, "num_tokens": tokens}


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_dump_progress_counts_finished_shards_at_the_first_the_last_and_when_due(tmp_path):
    out = tmp_path / "store"
    out.mkdir()
    _finish(out, 0, 500)  # kept from an earlier run: not this run's progress
    stream = io.StringIO()
    progress = ShardProgress(out, 3, known={0}, every_s=3600, stream=stream)
    progress.poll()
    (out / store.shard_name(1)).mkdir()  # a shard being written at a URL: no record yet
    (out / f".{store.shard_name(2)}.tmp-1").mkdir()  # a local writer's temporary
    progress.poll()
    assert _lines(stream) == []  # nothing finished: no line, and no rate to give
    _finish(out, 1, 100)
    progress.poll()
    [first] = _lines(stream)
    assert first.startswith("[specdraft] dump 1/3 shards tok/s ") and " eta " in first
    _finish(out, 2, 100)
    progress.poll()
    assert len(_lines(stream)) == 1 and progress.lines.done == 2 and progress.lines.tokens == 200  # not due yet
    progress.lines.every_s = 0.0  # due: a line even with no new shard (a slow shard is not silence)
    progress.poll()
    assert _lines(stream)[-1].startswith("[specdraft] dump 2/3 shards tok/s ")
    progress.lines.every_s = 3600
    _finish(out, 3, 100)
    progress.poll()
    progress.poll()  # done: the last line once
    assert len(_lines(stream)) == 3 and _lines(stream)[-1].startswith("[specdraft] dump 3/3 shards tok/s ")
    assert _lines(stream)[-1].endswith(" eta 0s")


def test_dump_progress_thread_polls_while_the_datasink_runs(tmp_path):
    out = tmp_path / "store"
    out.mkdir()
    stream = io.StringIO()
    with ShardProgress(out, 2, known=set(), every_s=3600, poll_s=0.01, stream=stream) as progress:
        assert _lines(stream) == [f"[specdraft] dump 0/2 shards (0 already in {out}): starting"]
        _finish(out, 0, 40)
        deadline = time.monotonic() + 10
        while progress.lines.done < 1 and time.monotonic() < deadline:  # the thread finds it, not the test
            time.sleep(0.01)
        assert progress.lines.done == 1 and _lines(stream)[-1].startswith("[specdraft] dump 1/2 shards")
        _finish(out, 1, 40)
    assert not progress.thread.is_alive()
    assert [line.split(" tok/s")[0] for line in _lines(stream)[1:]] == ["[specdraft] dump 1/2 shards",
                                                                         "[specdraft] dump 2/2 shards"]
