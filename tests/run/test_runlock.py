"""gti.run.runlock: one writer per run folder. A holder in another process refuses a second writer
with one line naming it; a killed holder's lock is taken over; the same process may re-enter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gti.run.runlock import LOCK_FILE, RunLock, RunLockedError, held_here, holder

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys, time
from gti.run.runlock import RunLock
with RunLock(sys.argv[1], what="gti run --config holder.yaml"):
    print("HELD", flush=True)
    time.sleep(600)
"""


def _holder_process(folder: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "HELD"
    return p


def test_a_second_writer_is_refused_naming_the_holder_and_a_killed_holders_lock_is_taken(tmp_path):
    run = tmp_path / "run"
    p = _holder_process(run)
    try:
        with pytest.raises(RunLockedError) as e:
            with RunLock(run, what="gti run --config second.yaml"):
                pass
        msg = str(e.value)
        assert f"pid {p.pid}" in msg and "gti run --config holder.yaml" in msg and "\n" not in msg
        assert holder(run)["pid"] == p.pid  # the refused writer left the holder's record alone
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # The holder died without releasing anything: the kernel dropped its lock.
    with RunLock(run, what="gti run --config second.yaml"):
        assert holder(run)["pid"] == os.getpid() and held_here(run)
    assert not held_here(run)


def test_the_same_process_reenters_and_releases_with_the_last_holder(tmp_path):
    run = tmp_path / "run"
    with RunLock(run):
        with RunLock(run / "." ):  # the same folder, spelled differently
            assert held_here(run)
        assert held_here(run)
    assert not held_here(run)
    assert (run / LOCK_FILE).is_file()
    # released: another process can take it at once
    p = _holder_process(run)
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_readers_do_not_block_on_a_held_lock(tmp_path):
    """Reading a locked folder's files takes no lock: nothing here waits."""
    run = tmp_path / "run"
    p = _holder_process(run)
    try:
        t0 = time.time()
        assert holder(run)["command"] == "gti run --config holder.yaml"
        assert time.time() - t0 < 1.0
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


# --------------------------------------------------------------------------- through the CLI
def _refused(capsys, argv, pid) -> None:
    from gti.cli import main

    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].startswith("gti: error: ") and f"pid {pid}" in err[-1], err
    assert "gti run --config holder.yaml" in err[-1] and "Traceback" not in "\n".join(err)


def test_every_writing_command_is_refused_on_a_held_folder(tmp_path, capsys):
    """`gti run`, `stage`, `tune` and `refresh` on a run folder whose lock another process
    holds: one line naming the holder, exit 2, nothing in the folder touched; `compare` on a
    held `--out` and `vocab ground` on a held `--out` the same."""
    tiny = ROOT / "jobs" / "configs" / "tiny.yaml"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("# the first run's config\n")
    p = _holder_process(run)
    before = {q: q.stat().st_mtime_ns for q in run.rglob("*")}
    try:
        base = ["--config", str(tiny), f"run_dir={run}"]
        _refused(capsys, ["run", *base, "--no-preflight"], p.pid)
        _refused(capsys, ["stage", "ingest", *base, "--no-preflight"], p.pid)
        _refused(capsys, ["tune", *base], p.pid)
        items = tmp_path / "new.csv"
        items.write_text("item_id,title\nn1,New thing\n")
        _refused(capsys, ["refresh", "--run-dir", str(run), "--items", str(items)], p.pid)
        assert {q: q.stat().st_mtime_ns for q in run.rglob("*")} == before  # untouched
        assert (run / "config.yaml").read_text() == "# the first run's config\n"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    out = tmp_path / "cmp"
    p = _holder_process(out)
    try:
        _refused(capsys, ["compare", "--config", str(tiny), f"run_dir={run}", "--arms", "mean,gti",
                          "--out", str(out)], p.pid)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_vocab_ground_is_refused_while_another_writes_the_same_out(tmp_path, capsys):
    from gti.run.runlock import RunLock

    out = tmp_path / "export"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    code = ("import sys, time\nfrom gti.run.runlock import RunLock\n"
            f"with RunLock({str(tmp_path)!r}, what='gti run --config holder.yaml', name='.export.gti.lock'):\n"
            "    print('HELD', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "HELD"
    try:
        tokens = tmp_path / "t.jsonl"
        tokens.write_text('{"token": "<x>", "descriptions": ["a thing"]}\n')
        _refused(capsys, ["vocab", "ground", "--model", str(tmp_path / "no-model"), "--tokens", str(tokens),
                          "--out", str(out)], p.pid)
        assert not out.exists()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # another --out in the same parent is not blocked by it
    with RunLock(tmp_path, name=".other.gti.lock"):
        pass
