"""The test session's budget of Ray Train runs and Ray instances (issue 27).

Every Train run (`gti.train.ray_train.run_trainer`) and every Ray instance a test starts appends a
line to the session's ledger (`gti.common.ledger`, file named by $GTI_RUN_LEDGER, inherited by
subprocesses and Ray workers). At the end of the session the counts are printed with the tests
that started them, written to `$GTI_TEST_LEDGER_REPORT` (if set), and the session FAILS when a
count exceeds the budget (`BUDGET` in tests/conftest.py). A new slow test must reuse what exists
(the session's Ray, the shared tiny upstream, one CLI run serving several assertions) or raise
the budget where a reviewer sees it. This is a count, not a timing: it does not drift with
machine load.

Used by tests/conftest.py (`install`, then the three hooks below imported into it) and by
tests/test_run_budget.py, which runs a session over its budget and checks that it fails.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from gti.common import ledger

_STATE: dict = {}


def install(budget: dict[str, int]) -> None:
    """Point $GTI_RUN_LEDGER at a fresh file for this session (before any Ray starts, so every
    worker inherits it) and remember the budget. An outer ledger (a caller auditing the whole
    run) is kept: this session then counts only the lines it adds.

    Under pytest-xdist each worker process counts into a file of its own (two workers' tests run
    at the same time, so lines in one shared file could not be told apart) and, when it ends,
    hands its lines to the controller's ledger tagged with the test that started them; the
    controller counts, reports and holds the budget for the whole suite."""
    path, own = os.environ.get(ledger.ENV), False
    parent = path if os.environ.get("PYTEST_XDIST_WORKER") else None
    if not path or parent:
        fd, path = tempfile.mkstemp(prefix="gti-test-ledger-", suffix=".jsonl")
        os.close(fd)
        os.environ[ledger.ENV] = path
        own = True
    _STATE.update(budget=dict(budget), path=path, own=own, parent=parent, start=len(ledger.read(path)),
                  per_test={}, spans=[])


def runtest_wrapper(item):
    """Attribute the ledger lines added while `item` ran (setup, call, teardown) to it. Lines
    written by a session fixture's setup land on the first test that used it."""
    if not _STATE:
        yield
        return
    before = len(ledger.read(_STATE["path"]))
    yield
    entries = ledger.read(_STATE["path"])
    if len(entries) > before:
        _STATE["per_test"][item.nodeid] = ledger.counts(entries[before:])
        _STATE["spans"].append((item.nodeid, before, len(entries)))


def verdict(counts: dict[str, int], budget: dict[str, int]) -> list[str]:
    """One message per kind whose count exceeds its budget ([] when within)."""
    return [f"{kind}: {counts.get(kind, 0)} started, budget {limit} (tests/conftest.py BUDGET)"
            for kind, limit in budget.items() if counts.get(kind, 0) > limit]


def _hand_to_controller() -> None:
    """An xdist worker's end: append its lines to the controller's ledger, each tagged with
    the test it is attributed to."""
    entries = ledger.read(_STATE["path"])
    tags = {i: nodeid for nodeid, lo, hi in _STATE["spans"] for i in range(lo, hi)}
    with open(_STATE["parent"], "a", encoding="utf-8") as f:
        for i, e in enumerate(entries[_STATE["start"]:], start=_STATE["start"]):
            f.write(json.dumps({**e, "tag": tags[i]} if i in tags else e) + "\n")


def _per_test(entries: list[dict]) -> dict[str, dict[str, int]]:
    """This process's own attribution plus the xdist workers' (their lines carry a tag)."""
    per_test = dict(_STATE["per_test"])
    tagged: dict[str, list[dict]] = {}
    for e in entries:
        if "tag" in e:
            tagged.setdefault(e["tag"], []).append(e)
    per_test.update({nodeid: ledger.counts(es) for nodeid, es in tagged.items()})
    return per_test


def finish(session, terminalreporter=None) -> None:
    """Count, report and fail the session when over budget (in an xdist worker: hand the lines
    over; the controller holds the budget)."""
    if not _STATE:
        return
    if _STATE["parent"]:
        _hand_to_controller()
        Path(_STATE["path"]).unlink(missing_ok=True)
        return
    entries = ledger.read(_STATE["path"])[_STATE["start"]:]
    counts = ledger.counts(entries)
    over = verdict(counts, _STATE["budget"])
    report = {"counts": counts, "budget": _STATE["budget"], "over": over,
              "per_test": _per_test(entries), "entries": entries}
    out = os.environ.get("GTI_TEST_LEDGER_REPORT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
    _STATE["report"] = report
    if _STATE["own"]:
        Path(_STATE["path"]).unlink(missing_ok=True)
    if over and session.exitstatus == 0:
        session.exitstatus = 1


def summary(terminalreporter) -> None:
    rep = _STATE.get("report")
    if not rep or not any(rep["counts"].values()):
        return
    tr = terminalreporter
    tr.section("Ray Train runs and Ray instances started (budget in tests/conftest.py)")
    c, b = rep["counts"], rep["budget"]
    tr.write_line(f"train runs: {c['train']} (budget {b.get('train')}), "
                  f"ray instances: {c['ray']} (budget {b.get('ray')})")
    for nodeid, n in sorted(rep["per_test"].items(), key=lambda kv: -kv[1]["train"]):
        tr.write_line(f"  {n['train']:2d} train, {n['ray']} ray  {nodeid}")
    for line in rep["over"]:
        tr.write_line(f"OVER BUDGET: {line}", red=True, bold=True)


# --------------------------------------------------------------------------- the hooks
# A conftest that calls `install` imports these three names; pytest registers them from there.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield from runtest_wrapper(item)


def pytest_sessionfinish(session, exitstatus):
    finish(session)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    summary(terminalreporter)
