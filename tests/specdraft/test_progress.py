"""Progress lines of long stages (``specdraft.progress``): one format for training and evaluation, printed at
the first item, the last, and at most every ``every_s`` seconds between."""

from __future__ import annotations

import io

from specdraft.progress import ProgressLines, eta_s, progress_line


def test_the_line_is_trainings_format():
    # 20 of 100 steps in 50 s: 200 s left at that rate
    assert eta_s(20, 100, 50.0) == 200.0 and eta_s(100, 100, 50.0) == 0.0 and eta_s(0, 0, 0.0) == 0.0
    assert (progress_line("step", 20, 100, 50.0, 5321.4, "stage 0 loss 4.1234")
            == "[specdraft] step 20/100 stage 0 loss 4.1234 tok/s 5321 eta 200s")
    assert progress_line("eval", 3, 4, 9.0, 12.0) == "[specdraft] eval 3/4 tok/s 12 eta 3s"


def test_lines_come_at_the_first_item_the_last_and_every_interval():
    now = [0.0]
    out = io.StringIO()
    lines = ProgressLines("eval", 5, "questions", every_s=30.0, stream=out, clock=lambda: now[0])
    for t, tokens in ((10.0, 100), (25.0, 50), (39.0, 40), (45.0, 10), (50.0, 0)):
        now[0] = t
        lines.update(1, tokens)
    # the first at 10 s; 25 s and 39 s are under 30 s after it (none); 45 s is 35 s after (due); the last at 50 s
    assert out.getvalue().splitlines() == [
        "[specdraft] eval 1/5 questions tok/s 10 eta 40s",  # 100 tokens in 10 s; 4 left at 10 s each
        "[specdraft] eval 4/5 questions tok/s 4 eta 11s",  # 200 tokens in 45 s; 45 / 0.8 * 0.2 s left
        "[specdraft] eval 5/5 questions tok/s 4 eta 0s",  # the last, whatever the interval
    ]
    quiet = io.StringIO()
    off = ProgressLines("eval", 2, "questions", enabled=False, stream=quiet)
    off.update(2, 10)
    assert quiet.getvalue() == "" and off.done == 2 and off.tokens == 10
