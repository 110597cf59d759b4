"""gti.common.progress: the plain (non-TTY) lines, rate and ETA, and the JSON-lines follower."""

from __future__ import annotations

import json

from gti.common.progress import JsonlFollower, Progress, format_duration


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_format_duration():
    assert format_duration(7.2) == "7s"
    assert format_duration(125) == "2m05s"
    assert format_duration(3725) == "1h02m"
    assert format_duration(float("inf")) == "?"


def test_plain_lines_every_interval_with_rate_and_eta():
    clock, lines = Clock(), []
    p = Progress(100, "embed", "items", log=lines.append, interval_s=10, tty=False, clock=clock)
    clock.t += 2
    p.update(10)  # first update always prints
    clock.t += 3
    p.update(10)  # 3 s after the last line: quiet
    clock.t += 7
    p.update(10)  # 10 s after the last line: prints
    assert lines == [
        "10/100 items (10.0%) 5.0 items/s ETA 18s",
        "30/100 items (30.0%) 2.0 items/s ETA 35s",  # rate from the first update on: 20 in 10 s
    ]
    clock.t += 1
    p.update(70)  # the last unit always prints, with the elapsed time instead of an ETA
    assert lines[-1] == "100/100 items (100.0%) 8.2 items/s in 13s"
    p.close()
    assert len(lines) == 3  # close does not repeat a line that is already out


def test_close_after_stopping_short_says_how_long_it_took():
    clock, lines = Clock(), []
    p = Progress(20, "sinkhorn", "rounds", log=lines.append, every_n=1, tty=False, clock=clock)
    for _ in range(2):
        clock.t += 1
        p.update(1, "colliding 10 -> 5")
    assert "ETA" in lines[-1]
    clock.t += 1
    p.close()
    assert lines[-1] == "2/20 rounds (10.0%) 1.0 rounds/s in 3s colliding 10 -> 5"


def test_every_n_and_postfix_and_close_prints_last_state():
    clock, lines = Clock(), []
    p = Progress(10, "training", "steps", log=lines.append, every_n=4, tty=False, clock=clock)
    for step in range(1, 7):
        clock.t += 2
        p.set(step, f"loss {1 / step:.2f}")
    assert [ln.split(" (")[0] for ln in lines] == ["1/10 steps", "4/10 steps"]
    assert lines[1].endswith("ETA 12s loss 0.25")
    assert " 2.0 s/step " in lines[1]  # slower than one per second: seconds per unit
    p.set(3)  # a replayed (older) record never moves the count back
    assert p.done == 6
    p.close()  # stopped before the total: the last state, with the time it took
    assert lines[-1] == "6/10 steps (60.0%) 2.0 s/step in 12s loss 0.17"


def test_default_log_prefixes_desc_and_slow_rates_read_as_seconds_per_unit(capsys):
    clock = Clock()
    import sys

    p = Progress(3, "sinkhorn", "rounds", tty=False, clock=clock, stream=sys.stdout)
    clock.t += 4
    p.update(1)
    out = capsys.readouterr().out
    assert out == "sinkhorn: 1/3 rounds (33.3%) 4.0 s/round ETA 8s\n"


def test_unknown_total_has_no_eta():
    clock, lines = Clock(), []
    p = Progress(None, "read", "rows", log=lines.append, tty=False, clock=clock)
    clock.t += 1
    p.update(5)
    assert lines == ["5 rows 5.0 rows/s in 1s"]


def test_tty_mode_draws_a_bar(tmp_path):
    class FakeTTY:
        def __init__(self) -> None:
            self.text = ""

        def write(self, s: str) -> int:
            self.text += s
            return len(s)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    stream, lines = FakeTTY(), []
    with Progress(50, "decode", "prompts", log=lines.append, stream=stream) as p:
        p.update(25, "x 1")
    assert lines == []  # no plain lines on a terminal
    assert "decode" in stream.text and "25/50" in stream.text and "x 1" in stream.text


def test_follower_reads_complete_lines_in_order(tmp_path):
    path = tmp_path / "p.jsonl"
    seen = []
    f = JsonlFollower(path, seen.append, poll_s=60)
    f.drain()  # no file yet: nothing
    with path.open("w") as fh:
        fh.write(json.dumps({"step": 1}) + "\n" + "not json\n" + '{"step": 2')  # last one incomplete
    f.drain()
    assert seen == [{"step": 1}]
    with path.open("a") as fh:
        fh.write("}\n")
    with f:  # exit drains once more
        pass
    assert seen == [{"step": 1}, {"step": 2}]


def test_rate_uses_the_time_each_unit_was_done_not_when_it_was_read():
    clock, lines = Clock(), []
    p = Progress(10, "training", "steps", log=lines.append, every_n=1, tty=False, clock=clock)
    clock.t = 130.0  # the driver reads three steps done at 110, 115 and 120 in one burst
    for step, at in ((1, 110.0), (2, 115.0), (3, 120.0)):
        p.set(step, at=at)
    assert lines[-1] == "3/10 steps (30.0%) 5.0 s/step ETA 35s"


def test_a_resumed_runs_earlier_steps_count_but_do_not_slow_the_rate():
    """A resumed run's progress file holds the killed attempt's steps, hours older: they set
    the count, and the rate is measured from the first step done after the Progress started."""
    clock, lines = Clock(), []
    p = Progress(100, "training", "steps", log=lines.append, every_n=1, tty=False, clock=clock)
    for step in range(1, 39):  # the killed attempt, 5 h earlier, 4 s a step
        p.set(step, at=100.0 - 18000 + 4 * step)
    clock.t = 200.0
    for step, at in ((26, 150.0), (38, 198.0), (39, 202.0), (40, 206.0)):  # replayed from the step-25 checkpoint
        p.set(step, at=at)
    assert p.done == 40
    assert lines[-1] == "40/100 steps (40.0%) 4.0 s/step ETA 4m00s"
