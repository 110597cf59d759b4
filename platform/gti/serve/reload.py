"""Which version of a run is served, and swapping in a newer one between requests.

What it is for: `ServiceHolder(load)` holds the `RecommenderService` that answers now and
reloads a `gti refresh` version in the background while the old one keeps answering, so no
answer mixes a model and a map of different versions and none fails because of the swap; a map
that does not descend from the serving model's (`gti.run.versions.check_model_map`) is refused
with ONE log line. Replicas agree through one rule over one shared record: `desired_version`
over a `VersionBoard` that every replica polls (docs/serving.md).

What it does NOT know: HTTP, batching, or Ray. `load(version)` is any callable returning a
service for a version; the board is any object with `pin(version, published)` and
`sync(replica, report)` (a Ray handle's adapter lives in gti.serve.deployment).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gti.common.errors import GtiError, one_line

log = logging.getLogger("gti.serve")


class ReloadBusy(GtiError):
    """A reload is already in progress."""


def desired_version(pin: dict[str, Any] | None, newest: int) -> int:
    """The version every replica should serve: the pinned one while `newest` is still the
    version that was newest when it was pinned (a pin lasts until the next publish), else the
    newest. The same inputs give every replica the same answer."""
    if pin and pin.get("version") is not None and pin.get("published") == newest:
        return int(pin["version"])
    return newest


class VersionBoard:
    """The record every replica of one app reads: the pin, and what each replica last reported.
    Plain state (no Ray): the Serve deployment `gti-versions` holds one for the replicas; a
    holder without a shared board keeps one of its own. `forget_s`: a replica not heard from
    for that long (dead, or replaced by Serve) leaves the table."""

    def __init__(self, version: int | None = None, published: int | None = None, forget_s: float = 60.0) -> None:
        self._pin: dict[str, Any] | None = {"version": version, "published": published, "seq": 0}
        self._seen: dict[str, dict[str, Any]] = {}
        self.forget_s = float(forget_s)

    def pin(self, version: int | None, published: int | None) -> dict[str, Any]:
        """Pin `version` (None: follow the newest) as of the newest version `published` now."""
        seq = (self._pin or {}).get("seq", 0) + 1
        self._pin = {"version": version, "published": published, "seq": seq}
        return dict(self._pin)

    def sync(self, replica: str, report: dict[str, Any] | None) -> dict[str, Any]:
        """Record `replica`'s report (None: only read) and return the pin and every replica
        heard from within `forget_s`, with the seconds since."""
        now = time.time()
        if report is not None:
            self._seen[replica] = {**report, "at": now}
        self._seen = {r: v for r, v in self._seen.items() if now - v["at"] <= self.forget_s}
        replicas = {r: {**{k: v for k, v in rep.items() if k != "at"}, "age_s": round(now - rep["at"], 1)}
                    for r, rep in sorted(self._seen.items())}
        return {"pin": dict(self._pin) if self._pin else None, "replicas": replicas}


class ServiceHolder:
    """The served `RecommenderService` and its reloads.

    `current` is the service that answers now (None until the first load finished: not ready).
    `reload(version=None)` (POST /admin/reload) loads a version in a background thread, then
    replaces the reference in one assignment: a request (or a batch) takes `current` once and is
    answered wholly by that run. `watch(interval_s)` runs `poll()` every interval, which reports
    this replica's version to the board (a shared one for all replicas of a Serve app: the
    `gti-versions` deployment; an in-process one otherwise), reads the pin back and starts a
    reload when the desired version differs from the served one. So every replica serves the
    same version within one poll interval plus one load after any reload, publish or pinned
    rollback; a version that is refused or fails to load is not retried until the pin or the
    newest version changes (the replica keeps its version and says so in `/info`).
    `status()` is what `/info` reports about this replica's reloads: {"state": "idle" |
    "loading" | "swapped" | "unchanged" | "refused" | "failed", "from", "to", "message"};
    `replicas()` what the board last heard from every replica (version, state, seconds since).
    `load` is `RecommenderService.load` with the replica's settings in `gti serve`.
    """

    def __init__(self, load: Callable[[int | None], Any], run_dir: str | Path,
                 logger: Callable[[str], None] | None = None, board: Any = None, replica: str = "local") -> None:
        self._load, self.run_dir = load, Path(run_dir).expanduser().resolve()
        self._log = logger or log.warning
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.current: Any = None
        # a shared board (Serve) already holds the app's starting pin; an own one gets it in load_initial
        self._shared, self._board, self.replica = board is not None, board or VersionBoard(), replica
        self._last: dict[str, Any] = {"pin": None, "replicas": {}}  # the board's last answer
        self._board_ok = False  # whether the last call to the board answered
        self._tried: int | None = None  # a desired version that was refused or failed: not retried
        self._stop = threading.Event()
        self._status: dict[str, Any] = {"state": "idle", "from": None, "to": None, "message": ""}

    def load_initial(self, version: int | None = None) -> Any:
        """Load the first version (blocking); errors propagate (the service cannot start). With
        a shared board the board's pin decides (a replica Serve restarts joins the others);
        else `version` is pinned as of the newest version published now."""
        try:
            newest: int | None = self._target(None, quiet=True)
        except Exception:  # noqa: BLE001 - the load below says what is wrong with the folder
            newest = None
        if not self._shared:
            self._board.pin(version, newest)
        pin = self._sync(report=False)
        if self._shared and not self._board_ok:  # the board not up yet: the app's start pin
            pin = {"version": version, "published": newest}
        if newest is not None and pin is not None:
            version = desired_version(pin, newest)
        self.current = self._load(version)
        self._sync()
        return self.current

    def poll(self) -> bool:
        """One look at the run folder and the board: report this replica's version, and start
        a reload (not waiting) when the desired version differs from the served one; True when
        it started one."""
        try:
            newest = self._target(None, quiet=True)
        except Exception as err:  # noqa: BLE001 - a half-written folder: look again next time
            log.debug("gti serve: poll: %s", err)
            return False
        pin = self._sync()
        if self._shared and not self._board_ok and pin is None:
            return False  # never heard from the board: keep the start version rather than guess
        want = desired_version(pin, newest)
        if (self.current is not None and want == self.current.version) or want == self._tried:
            return False
        try:
            self._start(want)
        except ReloadBusy:
            return False  # look again after the reload under way
        self._tried = want
        return True

    def _sync(self, report: bool = True) -> dict[str, Any] | None:
        """Report this replica to the board and keep its answer; the pin (the last one known
        when the board cannot be reached: a replica keeps its version rather than guess)."""
        cur = self.current
        rep = {"version": cur.version, "map_hash": getattr(cur, "map_hash", None),
               "state": self.status()["state"]} if report and cur is not None else None
        try:
            self._last, self._board_ok = self._board.sync(self.replica, rep), True
        except Exception as err:  # noqa: BLE001 - the board restarting: try again at the next poll
            self._board_ok = False
            log.debug("gti serve: version board: %s", err)
        return self._last.get("pin")

    def replicas(self) -> dict[str, Any]:
        """What the board last heard from each replica (GET /info "replicas"), and whether
        they all serve the same version."""
        table = self._last.get("replicas") or {}
        versions = {r.get("version") for r in table.values()}
        return {"agree": len(versions) <= 1, "pin": self._last.get("pin"), "each": table}

    def watch(self, interval_s: float) -> threading.Thread | None:
        """Poll every `interval_s` seconds in a daemon thread until `close()` (0: no thread)."""
        if interval_s <= 0:
            return None

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.poll()
        thread = threading.Thread(target=loop, name="gti-serve-watch", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._stop.set()

    @property
    def ready(self) -> bool:
        return self.current is not None

    def status(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._status)

    def reload(self, version: int | None = None, wait: bool = False) -> dict[str, Any]:
        """POST /admin/reload: pin `version` (None: follow the newest) on the board, so every
        replica moves to it at its next poll, and start loading it here in the background; with
        `wait`, return only once it is swapped in or refused. ReloadBusy while one is in
        progress. A version that does not exist is not pinned (the load says why it failed)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise ReloadBusy(f"a reload to version {self._status['to']} is in progress")
        try:
            newest = self._target(None, quiet=True)
            if version is not None:
                self._target(version, quiet=True)
        except Exception:  # noqa: BLE001 - reported by the load below, in one line
            newest = None
        if newest is not None:
            try:
                self._board.pin(version, newest)
            except Exception as err:  # noqa: BLE001 - this replica still reloads; said once
                self._log(f"gti serve: the other replicas were not told of this reload: {one_line(str(err))}")
        self._tried = None  # asked for by hand: tried again even if it failed before
        return self._start(version, wait)

    def _start(self, version: int | None, wait: bool = False) -> dict[str, Any]:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise ReloadBusy(f"a reload to version {self._status['to']} is in progress")
            frm = self.current.version if self.current is not None else None
            self._status = {"state": "loading", "from": frm, "to": version, "message": ""}
            self._thread = threading.Thread(target=self._run, args=(version,), name="gti-serve-reload", daemon=True)
            self._thread.start()
            thread = self._thread
        if wait:
            thread.join()
        return self.status()

    def _run(self, version: int | None) -> None:
        try:
            target = self._target(version)
            self._set(to=target)
            if self.current is not None and target == self.current.version:
                self._set(state="unchanged", message=f"already serving version {target}")
                return
            self._check_descends(target)
            new = self._load(target)
        except GtiError as err:
            state = "refused" if _is_lineage_error(err) else "failed"
            msg = one_line(str(err))
            self._log(f"gti serve: reload to version {self._status['to']} {state}, still serving version "
                      f"{self.current.version if self.current is not None else None}: {msg}")
            self._set(state=state, message=msg)
            return
        except Exception as err:  # noqa: BLE001 - a failed load never takes the old version down
            msg = one_line(f"{type(err).__name__}: {err}")
            self._log(f"gti serve: reload to version {self._status['to']} failed: {msg}")
            self._set(state="failed", message=msg)
            return
        self.current = new  # one assignment: requests after it see the new run, earlier ones the old
        self._set(state="swapped", message=f"now serving version {new.version} (map {new.map_hash})")
        self._sync()  # the board hears of the swap now, not a poll later

    def _set(self, **kv: Any) -> None:
        with self._lock:
            self._status.update(kv)

    def _target(self, version: int | None, quiet: bool = False) -> int:
        from gti.run.versions import chosen_version

        # quiet: a poll every few seconds must not repeat the line about a skipped stale version
        chosen = chosen_version(self.run_dir, version, **({"note": lambda line: None} if quiet else {}))
        return chosen.k if chosen is not None else 0

    def _check_descends(self, target: int) -> None:
        """UnrelatedSidMapError unless version `target`'s map descends from the map the serving
        model was trained with (codes it adds are fine: the new version has its own model), or,
        for a rollback, the serving map descends from the map `target`'s own model was trained
        with (an older version of the same lineage: every item it knows keeps its SID)."""
        if self.current is None:
            return
        from gti.run.versions import check_model_map, lineage_dir, resolve
        from gti.sid.versions import MissingSidTokensError, UnrelatedSidMapError

        at = resolve(self.run_dir, target, note=lambda line: None, find_model=False)
        lineage = lineage_dir(self.run_dir)
        try:
            check_model_map(self.current.run.model_dir, at.map_hash, map_path=at.map_path, lineage=lineage)
        except MissingSidTokensError:
            pass
        except UnrelatedSidMapError as first:
            now = resolve(self.run_dir, self.current.version, note=lambda line: None, find_model=False)
            older = resolve(self.run_dir, target, note=lambda line: None)
            try:  # the rollback direction
                check_model_map(older.model_dir, now.map_hash, map_path=now.map_path, lineage=lineage)
            except MissingSidTokensError:
                pass
            except UnrelatedSidMapError:
                raise first from None  # the forward refusal is the one worth reading


def _is_lineage_error(err: Exception) -> bool:
    from gti.sid.versions import UnrelatedSidMapError

    return isinstance(err, UnrelatedSidMapError)
