"""gti/serve/reload.py with stand-in services (no model): the first load, a swap, a reload
already under way (ReloadBusy), a load that fails keeps the old version with one log line,
"unchanged" when the newest version is the one served, and `poll()` following publishes (a
new version is loaded once; a refused one is logged once and not retried), and replicas that
agree: `desired_version`'s rule, the `VersionBoard`, and two holders sharing one board (two
replicas) converging on one version after a pinned reload on one of them, a publish and a pinned
rollback, with `replicas()` naming each one's version. The lineage refusal on a real run is in
test_app.py; the same on two live Serve replicas in test_deployment_live.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from gti.common.errors import DataError
from gti.serve.reload import ReloadBusy, ServiceHolder, VersionBoard, desired_version


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
    h._board.pin(1, 1)  # as if v2 were published after the start (pinned while v1 was the newest)
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


def test_desired_version_follows_a_pin_until_the_next_publish():
    assert desired_version(None, 3) == 3
    assert desired_version({"version": None, "published": 3}, 3) == 3  # no pin: the newest
    assert desired_version({"version": 1, "published": 3}, 3) == 1  # pinned (a rollback)
    assert desired_version({"version": 0, "published": 3}, 3) == 0  # the run's own stages
    assert desired_version({"version": 1, "published": 3}, 4) == 4  # published since: the newest


def test_the_board_keeps_the_pin_and_forgets_silent_replicas(monkeypatch):
    import gti.serve.reload as R

    now = [1000.0]
    monkeypatch.setattr(R.time, "time", lambda: now[0])
    b = VersionBoard(2, 3, forget_s=10)
    assert b.sync("a", None) == {"pin": {"version": 2, "published": 3, "seq": 0}, "replicas": {}}
    b.sync("a", {"version": 2, "state": "idle"})
    now[0] += 4
    seen = b.sync("b", {"version": 3, "state": "swapped"})
    assert seen["replicas"] == {"a": {"version": 2, "state": "idle", "age_s": 4.0},
                                "b": {"version": 3, "state": "swapped", "age_s": 0.0}}
    assert b.pin(None, 3) == {"version": None, "published": 3, "seq": 1}
    now[0] += 8  # a: 12 s without a word (dead, or replaced by Serve)
    assert list(b.sync("b", None)["replicas"]) == ["b"]


def test_two_replicas_on_one_board_converge_after_any_reload(publishable, monkeypatch):
    """Replicas a and b share one board (as the Serve replicas share gti-versions). A pinned
    reload reaching a alone, a publish, a pinned rollback and a reload to the newest: after each,
    one poll of each replica and both serve the same version, and replicas() says so."""
    run, publish = publishable["run"], publishable["publish"]
    monkeypatch.setattr(ServiceHolder, "_check_descends", lambda self, target: None)
    board = VersionBoard(None, 1)  # started without --version; v1 published
    a, b = (ServiceHolder(_fake, run, board=board, replica=r) for r in "ab")

    def settle():
        for h in (a, b):
            h.poll()
            if h._thread is not None:
                h._thread.join(10)
        a.poll(), b.poll()  # report what each serves now
        return a.current.version, b.current.version

    assert a.load_initial(None).version == 1 and b.load_initial(None).version == 1
    a.reload(0, wait=True)  # POST /admin/reload {"version": 0} reaches a only
    assert a.current.version == 0 and b.current.version == 1  # b moves at its next poll
    assert settle() == (0, 0)
    seen = a.replicas()
    assert seen["agree"] and seen["pin"] == {"version": 0, "published": 1, "seq": 1}
    assert {r: (v["version"], v["map_hash"], v["state"]) for r, v in seen["each"].items()} \
        == {"a": (0, "h0", "swapped"), "b": (0, "h0", "swapped")}
    publish(2, ["new2"])  # a publish ends the pin: both move to it
    assert settle() == (2, 2)
    b.reload(1, wait=True)  # a pinned rollback through b
    assert settle() == (1, 1)
    assert settle() == (1, 1)  # and it stays (no flapping back to the newest)
    a.reload(None, wait=True)  # back to following the newest
    assert settle() == (2, 2) and a.replicas()["agree"] and b.replicas()["agree"]
    # A replica that (re)starts later joins the agreed version, not its start one.
    b.reload(1, wait=True)
    c = ServiceHolder(_fake, run, board=board, replica="c")
    assert c.load_initial(None).version == 1


def test_a_replica_that_cannot_load_the_pin_keeps_its_version_and_says_so(publishable, monkeypatch):
    run = publishable["run"]
    monkeypatch.setattr(ServiceHolder, "_check_descends", lambda self, target: None)
    board, logs = VersionBoard(None, 1), []

    def broken_v0(v):
        if v == 0:
            raise DataError("model folder unreadable on this node")
        return _fake(v)

    a = ServiceHolder(_fake, run, board=board, replica="a")
    b = ServiceHolder(broken_v0, run, board=board, replica="b", logger=logs.append)
    a.load_initial(None), b.load_initial(None)
    a.reload(0, wait=True)
    assert b.poll() is True
    b._thread.join(10)
    assert b.current.version == 1 and b.status()["state"] == "failed" and len(logs) == 1
    assert b.poll() is False and len(logs) == 1  # not retried every poll
    a.poll()
    rep = a.replicas()
    assert rep["agree"] is False and rep["each"]["b"]["state"] == "failed" and rep["each"]["b"]["version"] == 1


def test_a_replica_starting_while_the_board_is_down_loads_the_apps_start_version(publishable):
    """The shared board not answering yet (Serve still starting it): the replica loads the
    version the app was started with (its --version), not the newest, and joins the board later."""
    class _Down:
        def pin(self, version, published):
            raise TimeoutError("board not up")

        def sync(self, replica, report):
            raise TimeoutError("board not up")

    h = ServiceHolder(_fake, publishable["run"], board=_Down(), replica="a")
    assert h.load_initial(0).version == 0  # the newest is 1
    assert h.poll() is False and h.current.version == 0  # no pin known: it keeps what it serves
