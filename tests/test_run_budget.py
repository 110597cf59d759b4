"""The session budget of Ray Train runs (tests/run_budget.py, BUDGET in tests/conftest.py): a
session whose tests start one Train run more than the budget fails, with the count and the
test that started them (at the budget it passes: every session of the suite is that case). The
inner session runs in a subprocess with its own ledger, and its "Train runs" go through the real
funnel (`gti.train.ray_train.run_trainer`) with Ray's TorchTrainer replaced by a stub: no Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

INNER_CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
import run_budget
from run_budget import pytest_runtest_protocol, pytest_sessionfinish, pytest_terminal_summary

run_budget.install({{"train": {budget}, "ray": 5}})
"""

INNER_TEST = """
from types import SimpleNamespace


class StubTrainer:
    def __init__(self, *a, **kw):
        pass

    def fit(self):
        import contextlib, tempfile
        d = tempfile.mkdtemp()

        class Ckpt:
            @contextlib.contextmanager
            def as_directory(self):
                yield d

        return SimpleNamespace(checkpoint=Ckpt(), metrics={{}}, path=d)


def test_two_train_runs(tmp_path, monkeypatch):
    import ray.train.torch
    from gti.train.ray_train import TrainerSpec, run_trainer

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", StubTrainer)
    for i in range(2):
        spec = TrainerSpec(name=f"r{{i}}", storage_path=tmp_path, num_workers=1)
        run_trainer(lambda c: None, {{}}, {{}}, spec, lambda d: "read")
"""


def _session(tmp_path: Path, budget: int, files: int = 1,
             args: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict]:
    d = tmp_path / f"budget{budget}"
    d.mkdir()
    (d / "conftest.py").write_text(INNER_CONFTEST.format(tests=str(TESTS), budget=budget))
    for k in range(files):
        (d / f"test_inner{k or ''}.py").write_text(INNER_TEST.format())
    report = d / "ledger.json"
    env = {k: v for k, v in os.environ.items() if k not in ("GTI_RUN_LEDGER", "GTI_TEST_LEDGER_REPORT")}
    env["GTI_TEST_LEDGER_REPORT"] = str(report)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(d),
                        "-c", os.devnull, *args, str(d)], cwd=d, env=env, capture_output=True, text=True, timeout=300)
    return p, json.loads(report.read_text()) if report.exists() else {}


def test_one_train_run_over_the_budget_fails_the_session(tmp_path):
    p, rep = _session(tmp_path, budget=1)
    out = p.stdout + p.stderr
    assert "1 passed" in out, out[-3000:]  # the test itself passed: the budget failed the session
    assert p.returncode == 1, out[-3000:]
    assert "OVER BUDGET: train: 2 started, budget 1" in out
    assert rep["counts"] == {"train": 2, "ray": 0}
    assert list(rep["per_test"].values()) == [{"train": 2, "ray": 0}]
    assert [e["name"] for e in rep["entries"]] == ["r0", "r1"]


def test_xdist_workers_hand_their_runs_to_the_controller_which_holds_the_budget(tmp_path):
    """`make test` runs the suite on two pytest-xdist workers, each counting into a ledger of
    its own; the controller must see both workers' runs (2 + 2 here, over a budget of 3)."""
    p, rep = _session(tmp_path, budget=3, files=2, args=("-n", "2", "--dist", "loadfile"))
    out = p.stdout + p.stderr
    assert "2 passed" in out, out[-3000:]
    assert p.returncode == 1, out[-3000:]
    assert "OVER BUDGET: train: 4 started, budget 3" in out
    assert rep["counts"] == {"train": 4, "ray": 0}
    assert rep["per_test"] == {"test_inner.py::test_two_train_runs": {"train": 2, "ray": 0},
                               "test_inner1.py::test_two_train_runs": {"train": 2, "ray": 0}}
    assert sorted(e["tag"] for e in rep["entries"]) == ["test_inner.py::test_two_train_runs"] * 2 + [
        "test_inner1.py::test_two_train_runs"] * 2


def test_verdict_names_each_kind_over_its_budget():
    import run_budget

    assert run_budget.verdict({"train": 3, "ray": 2}, {"train": 3, "ray": 1}) == [
        "ray: 2 started, budget 1 (tests/conftest.py BUDGET)"]
    assert run_budget.verdict({"train": 0, "ray": 0}, {"train": 0, "ray": 0}) == []
