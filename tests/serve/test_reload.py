"""gti/serve/reload.py with stand-in services (no model): the first load, a swap, a reload
already under way (ReloadBusy), a load that fails keeps the old version with one log line,
"unchanged" when the newest version is the one served, and `poll()` following publishes (a
new version is loaded once; a refused one is logged once and not retried). The lineage refusal on a real run
is in test_app.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gti.errors import DataError
from gti.serve.reload import ReloadBusy, ServiceHolder


def _fake(version):
    return SimpleNamespace(version=version, map_hash=f"h{version}", run=SimpleNamespace(model_dir="unused"))


@pytest.fixture
def run_dir(serve_run):
    return serve_run["run"]  # has v1: the newest version is 1


def test_first_load_and_ready(run_dir):
    h = ServiceHolder(_fake, run_dir)
    assert not h.ready and h.current is None
    assert h.load_initial(1).version == 1 and h.ready
    assert h.status()["state"] == "idle"


def test_unchanged_when_serving_the_newest(run_dir):
    h = ServiceHolder(_fake, run_dir)
    h.load_initial(1)
    assert h.reload(wait=True)["state"] == "unchanged"


def test_a_failed_load_keeps_the_old_version_with_one_log_line(run_dir, monkeypatch):
    logs = []

    def load(v):
        if v == 1:
            raise DataError("broken model folder")
        return _fake(v)

    h = ServiceHolder(load, run_dir, logger=logs.append)
    h.load_initial(0)
    monkeypatch.setattr(ServiceHolder, "_check_descends", lambda self, target: None)
    st = h.reload(1, wait=True)
    assert st["state"] == "failed" and "broken model folder" in st["message"]
    assert h.current.version == 0 and len(logs) == 1 and "still serving version 0" in logs[0]


def test_one_reload_at_a_time_then_swap(run_dir, monkeypatch):
    gate = threading.Event()

    def load(v):
        if v == 1:
            gate.wait(10)
        return _fake(v)

    h = ServiceHolder(load, run_dir)
    h.load_initial(0)
    monkeypatch.setattr(ServiceHolder, "_check_descends", lambda self, target: None)
    assert h.reload(1)["state"] == "loading"
    with pytest.raises(ReloadBusy, match="in progress"):
        h.reload(1)
    assert h.current.version == 0  # the old one serves while the new one loads
    gate.set()
    h._thread.join(10)
    assert h.current.version == 1 and h.status() == {"state": "swapped", "from": 0, "to": 1,
                                                      "message": "now serving version 1 (map h1)"}


def test_poll_loads_a_newly_published_version_once(publishable, monkeypatch):
    run, publish = publishable["run"], publishable["publish"]
    loads = []
    h = ServiceHolder(lambda v: loads.append(v) or _fake(v), run)
    h.load_initial(0)  # pinned to the run's own stages; v1 was published before the start
    monkeypatch.setattr(ServiceHolder, "_check_descends", lambda self, target: None)
    assert h.poll() is False and loads == [0]  # nothing new since the start: v0 stays
    publish(2, ["new2"])
    assert h.poll() is True
    h._thread.join(10)
    assert h.current.version == 2 and h.status()["state"] == "swapped" and loads == [0, 2]
    assert h.poll() is False and loads == [0, 2]


def test_poll_refuses_a_non_descendant_version_once(bad_run, serve_run):
    """v2 of bad_run changes an old item's SID: refused with one line, v1 keeps serving, and
    the next polls leave it alone (no log line every interval)."""
    logs = []
    model_dir = bad_run["run"] / "refresh" / "v1" / "model"
    h = ServiceHolder(lambda v: SimpleNamespace(version=v, map_hash="h", run=SimpleNamespace(model_dir=model_dir)),
                      bad_run["run"], logger=logs.append)
    h.load_initial(1)
    h._seen = 1  # as if v2 were published after the start
    assert h.poll() is True
    h._thread.join(10)
    assert h.status()["state"] == "refused" and h.current.version == 1 and len(logs) == 1
    assert h.poll() is False and len(logs) == 1


def test_watch_polls_until_closed(run_dir, monkeypatch):
    h = ServiceHolder(_fake, run_dir)
    polled = threading.Event()
    monkeypatch.setattr(h, "poll", lambda: polled.set())
    assert h.watch(0) is None  # 0: no thread
    thread = h.watch(0.01)
    assert polled.wait(5)
    h.close()
    thread.join(5)
    assert not thread.is_alive()
