"""The test session's budget of Ray Train runs and Ray instances (issue 27).

Every Train run (`gti.train.driver.run_trainer`) and every Ray instance a test starts appends a
line to the session's ledger (`gti.ledger`, file named by $GTI_RUN_LEDGER, inherited by
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

from gti import ledger

_STATE: dict = {}


def install(budget: dict[str, int]) -> None:
    """Point $GTI_RUN_LEDGER at a fresh file for this session (before any Ray starts, so every
    worker inherits it) and remember the budget. An outer ledger (a caller auditing the whole
    run) is kept: this session then counts only the lines it adds."""
    path, own = os.environ.get(ledger.ENV), False
    if not path:
        fd, path = tempfile.mkstemp(prefix="gti-test-ledger-", suffix=".jsonl")
        os.close(fd)
        os.environ[ledger.ENV] = path
        own = True
    _STATE.update(budget=dict(budget), path=path, own=own, start=len(ledger.read(path)), per_test={})


def runtest_wrapper(item):
    """Attribute the ledger lines added while `item` ran (setup, call, teardown) to it. Lines
    written by a session fixture's setup land on the first test that used it."""
    if not _STATE:
        yield
        return
    before = len(ledger.read(_STATE["path"]))
    yield
    added = ledger.read(_STATE["path"])[before:]
    if added:
        _STATE["per_test"][item.nodeid] = ledger.counts(added)


def verdict(counts: dict[str, int], budget: dict[str, int]) -> list[str]:
    """One message per kind whose count exceeds its budget ([] when within)."""
    return [f"{kind}: {counts.get(kind, 0)} started, budget {limit} (tests/conftest.py BUDGET)"
            for kind, limit in budget.items() if counts.get(kind, 0) > limit]


def finish(session, terminalreporter=None) -> None:
    """Count, report and fail the session when over budget."""
    if not _STATE:
        return
    entries = ledger.read(_STATE["path"])[_STATE["start"]:]
    counts = ledger.counts(entries)
    over = verdict(counts, _STATE["budget"])
    report = {"counts": counts, "budget": _STATE["budget"], "over": over,
              "per_test": _STATE["per_test"], "entries": entries}
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
