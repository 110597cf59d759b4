"""Damaged input files through the real CLI (`gti run --to ingest`) on Ray (issue 18): each case
is one line `gti: error: <file>: <what>` naming the exact file, exit 2, no traceback, no ANSI
codes, no completed-looking stage directory; `data.on_unreadable_file=skip` goes on and records
the skipped file in the manifest.

The first test runs `gti` as a subprocess (its own local Ray, with worker output forwarded to
the driver, as a user sees it); the others call `gti.cli.main` in-process on the shared Ray.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gti.cli import main
from gti.run.manifest import Manifest

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "jobs" / "configs" / "tiny.yaml")
BIG = 120_000  # rows: the damage lies beyond what the driver's header check reads


def _args(run_dir: Path, items: Path, inter: Path, *extra: str) -> list[str]:
    return ["run", "-c", TINY, "--to", "ingest", f"run_dir={run_dir}", f"data.items.path={items}",
            f"data.interactions.path={inter}", "data.max_items=null", *extra]


def _check_one_line_failure(rc: int, err: str, run_dir: Path) -> str:
    """The common promises; returns the error line."""
    assert rc == 2, err[-3000:]
    assert "Traceback" not in err and "\x1b[" not in err and "ray::" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("gti: error: ")
    assert not (run_dir / "ingest").exists()  # only the hidden .ingest.partial is left
    return last


def test_corrupt_parquet_page_via_the_gti_command(damaged, tmp_path):
    cat_dir = damaged.parquet_parts("catalog", damage=(1, 2))
    inter = damaged.interactions_csv(tmp_path / "inter.csv", n_users=300, n_items=3000)
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "gti", *_args(run_dir, cat_dir, inter)], capture_output=True,
                         text=True, timeout=400, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    last = _check_one_line_failure(out.returncode, out.stderr, run_dir)
    assert last.startswith(f"gti: error: {cat_dir / 'part-1.parquet'}: row group 2 (data rows 500-749) is damaged: ")


# One stream for every in-process run: Ray Data binds its log handler to the sys.stderr of its
# first use, and capsys' per-test streams are closed after their test (logging would then print
# "--- Logging error ---" tracebacks into the next test's output).
_ERR = io.StringIO()


def _run(capsys, *args) -> tuple[int, str]:
    _ERR.seek(0)
    _ERR.truncate()
    with contextlib.redirect_stderr(_ERR):
        rc = main(list(args))
    return rc, _ERR.getvalue()


def test_truncated_gzip_csv_and_jsonl(damaged, tmp_path, capsys, ray_start_4_cpus):
    inter = damaged.interactions_csv(tmp_path / "inter.csv", n_users=50, n_items=300)
    csv_gz = damaged.truncated_gzip("items.csv.gz", damaged.items_csv(BIG))
    rc, err = _run(capsys, *_args(tmp_path / "r1", csv_gz, inter))
    last = _check_one_line_failure(rc, err, tmp_path / "r1")
    assert "read task(s) from" in err  # past the driver's checks: the read task found it
    assert re.fullmatch(rf"gti: error: {re.escape(str(csv_gz))}: cannot read( \(after the first \d+ data rows\))?: "
                        r"Truncated compressed stream", last)
    jsonl_gz = damaged.truncated_gzip("items.jsonl.gz", damaged.items_jsonl(BIG))
    rc, err = _run(capsys, *_args(tmp_path / "r2", jsonl_gz, inter))
    last = _check_one_line_failure(rc, err, tmp_path / "r2")
    assert re.fullmatch(rf"gti: error: {re.escape(str(jsonl_gz))}: cannot read after line \d+: "
                        r"Truncated compressed stream", last)
    # A small one fails in the driver's header check, before Ray reads anything.
    small = damaged.truncated_gzip("small.csv.gz", damaged.items_csv(20))
    rc, err = _run(capsys, *_args(tmp_path / "r3", small, inter))
    assert _check_one_line_failure(rc, err, tmp_path / "r3") == f"gti: error: {small}: cannot read: Truncated compressed stream"


def test_corrupt_parquet_page_error_and_skip(damaged, tmp_path, capsys, ray_start_4_cpus):
    cat_dir = damaged.parquet_parts("catalog", damage=(1, 2))
    inter = damaged.interactions_csv(tmp_path / "inter.csv", n_users=300, n_items=3000)
    rc, err = _run(capsys, *_args(tmp_path / "r1", cat_dir, inter))
    last = _check_one_line_failure(rc, err, tmp_path / "r1")
    assert last.startswith(f"gti: error: {cat_dir / 'part-1.parquet'}: row group 2 (data rows 500-749) is damaged: ")
    rc, err = _run(capsys, *_args(tmp_path / "r2", cat_dir, inter, "data.on_unreadable_file=skip"))
    assert rc == 0, err[-3000:]
    assert f"WARNING: items: skipped unreadable file {cat_dir / 'part-1.parquet'}: row group 2" in err
    f = Manifest.read(tmp_path / "r2" / "ingest").facts
    assert [s["file"] for s in f["skipped_files"]["items"]] == [str(cat_dir / "part-1.parquet")]
    assert f["items_rows_in"] == f["items_rows_ok"] == 2000  # parts 0 and 2; nothing of part 1
    assert f["skipped_files_rows_in"].startswith("unknown")
    assert f["interactions_rows_in"] == f["interactions_rows_ok"] + f["interactions_rows_quarantined"]


def test_zero_byte_part_empty_directory_and_ragged_row(damaged, tmp_path, capsys, ray_start_4_cpus):
    inter = damaged.interactions_csv(tmp_path / "inter.csv", n_users=50, n_items=2000)
    cat_dir = damaged.parquet_parts("catalog", n_parts=2)
    (cat_dir / "part-5.parquet").write_bytes(b"")
    rc, err = _run(capsys, *_args(tmp_path / "r1", cat_dir, inter))
    assert _check_one_line_failure(rc, err, tmp_path / "r1") == (
        f"gti: error: {cat_dir / 'part-5.parquet'}: not a readable parquet file: Parquet file size is 0 bytes")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "_SUCCESS").write_text("")
    rc, err = _run(capsys, *_args(tmp_path / "r2", empty, inter))
    assert _check_one_line_failure(rc, err, tmp_path / "r2") == f"gti: error: data.items.path: no data files match {empty}"
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("item_id,title\n1,Beaker\n2,Flask\n3,Pipette\n4,Tube,extra\n5,Cap\n")
    rc, err = _run(capsys, *_args(tmp_path / "r3", ragged, inter))
    assert _check_one_line_failure(rc, err, tmp_path / "r3") == (
        f"gti: error: {ragged}: CSV parse error at data row 3 (line 5): "
        "Expected 2 columns, got 3: 4,Tube,extra")


def test_wrong_interactions_column_fails_before_any_work(tmp_path, capsys, ray_start_4_cpus):
    items = tmp_path / "items.csv"
    items.write_text("item_id,title\n1,A\n2,B\n")
    inter = tmp_path / "inter.csv"
    inter.write_text("uid,item_id,ts\nu,1,1\n")
    rc, err = _run(capsys, *_args(tmp_path / "r", items, inter))
    last = _check_one_line_failure(rc, err, tmp_path / "r")
    assert last.startswith(f"gti: error: {inter}: missing column 'user_id'")
    assert "[ingest] items:" not in err  # not a single item was read
