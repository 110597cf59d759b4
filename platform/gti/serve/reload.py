"""Which version of a run is served, and swapping in a newer one between requests.

What it is for: `ServiceHolder(load)` holds the `RecommenderService` that answers now
(`current`; None until the first load finished: not ready). `reload(version=None)` (POST
/admin/reload) loads a `gti refresh` version (None: the newest) in a background thread while
the old one keeps answering, then replaces the reference in one assignment: a request (or a
batch) takes `current` once and is answered wholly by that run, so no answer mixes a model and
a map of different versions, and none fails because of the swap. Before loading, the new
version's SID map must descend from the serving model's map (`gti.run_versions.check_model_map`
on the serving model folder, the run's lineage folder; a map that only adds code tokens the
serving model lacks still descends: the new version brings its own model with them). A map
that does not descend (or a version that fails to load) is refused with ONE log line and the
old version keeps serving. `watch(interval_s)` follows `gti refresh` publishes: a daemon thread
calls `poll()` every interval, which starts a reload when the newest finished version differs
from the newest one it saw before (a refused or failed one is not retried until a newer one is
published; a version pinned by /admin/reload stays until the next publish). `status()` is
what `/info` reports about reloads: {"state": "idle" | "loading" | "swapped" | "unchanged" |
"refused" | "failed", "from", "to", "message"}.

What it does NOT know: HTTP, batching, or Ray. `load(version)` is any callable returning a
service for a version (`RecommenderService.load` with the replica's settings).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

from gti.errors import GtiError, one_line

log = logging.getLogger("gti.serve")


class ReloadBusy(GtiError):
    """A reload is already in progress."""


class ServiceHolder:
    """The served `RecommenderService` and its reloads (see the module docstring)."""

    def __init__(self, load: Callable[[int | None], Any], run_dir: str | Path,
                 logger: Callable[[str], None] | None = None) -> None:
        self._load, self.run_dir = load, Path(run_dir).expanduser().resolve()
        self._log = logger or log.warning
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.current: Any = None
        self._seen: int | None = None  # the newest published version seen by poll()
        self._stop = threading.Event()
        self._status: dict[str, Any] = {"state": "idle", "from": None, "to": None, "message": ""}

    def load_initial(self, version: int | None = None) -> Any:
        """Load the first version (blocking); errors propagate (the service cannot start)."""
        try:  # what is published now: poll() acts on what comes after
            self._seen = self._target(None, quiet=True)
        except Exception:  # noqa: BLE001 - the load below says what is wrong with the folder
            self._seen = None
        self.current = self._load(version)
        return self.current

    def poll(self) -> bool:
        """One look at the run folder: start a reload (not waiting) when a version newer than
        the last one seen is published; True when it started one."""
        try:
            newest = self._target(None, quiet=True)
        except Exception as err:  # noqa: BLE001 - a half-written folder: look again next time
            log.debug("gti serve: poll: %s", err)
            return False
        if newest == self._seen:
            return False
        try:
            self.reload(newest)
        except ReloadBusy:
            return False  # look again after the reload under way
        self._seen = newest
        return True

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
        """Start loading `version` (None: the newest) in the background; with `wait`, return
        only once it is swapped in or refused. ReloadBusy while one is in progress."""
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

    def _set(self, **kv: Any) -> None:
        with self._lock:
            self._status.update(kv)

    def _target(self, version: int | None, quiet: bool = False) -> int:
        from gti.run_versions import chosen_version

        # quiet: a poll every few seconds must not repeat the line about a skipped stale version
        chosen = chosen_version(self.run_dir, version, **({"note": lambda line: None} if quiet else {}))
        return chosen.k if chosen is not None else 0

    def _check_descends(self, target: int) -> None:
        """UnrelatedSidMapError unless version `target`'s map descends from the map the serving
        model was trained with (codes it adds are fine: the new version has its own model)."""
        if self.current is None:
            return
        from gti.run_versions import check_model_map, lineage_dir, resolve
        from gti.sid.versions import MissingSidTokensError

        at = resolve(self.run_dir, target, note=lambda line: None, find_model=False)
        try:
            check_model_map(self.current.run.model_dir, at.map_hash, map_path=at.map_path,
                            lineage=lineage_dir(self.run_dir))
        except MissingSidTokensError:
            pass


def _is_lineage_error(err: Exception) -> bool:
    from gti.sid.versions import UnrelatedSidMapError

    return isinstance(err, UnrelatedSidMapError)
