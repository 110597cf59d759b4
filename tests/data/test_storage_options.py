"""Issue 30, item 8: `data.<source>.storage_options` reach the file system (so a private
bucket can be read), and the credentials of a data URI never reach a quarantine row's
`source_file`, the skipped-file facts, or an error line.

The bucket is an fsspec file system registered under the scheme `gtitest`: an in-memory store
that refuses to open without `token=<TOKEN>` (as a private bucket would), no network."""

from __future__ import annotations

import pytest

from gti.data import sources
from gti.data.sources import expand_paths, plan_tasks
from gti.common.errors import DataError
from gti.common.redact import REDACTED

TOKEN = "tok-s3cr3t"
PASSWORD = "pw-s3cr3t"


@pytest.fixture
def bucket():
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class PrivateBucket(MemoryFileSystem):
        protocol = ("gtitest",)
        store: dict = {}
        pseudo_dirs = [""]
        opened_with: list = []

        def __init__(self, *args, token=None, **kw):
            if token != TOKEN:
                raise PermissionError("gtitest: access denied (no valid token)")
            PrivateBucket.opened_with.append(token)
            super().__init__(*args, **kw)

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            if path.startswith("gtitest://"):
                path = path[len("gtitest://"):]
            return path.strip("/")  # "bucket/key", as s3fs and gcsfs have it

    fsspec.register_implementation("gtitest", PrivateBucket, clobber=True)
    fs = fsspec.filesystem("gtitest", token=TOKEN)
    base = f"gtitest://reader:{PASSWORD}@bucket"
    fs.pipe(f"{base}/items.csv", b"item_id,title\n1,Beaker\n2,Flask\n3,Pipette\n")
    fs.pipe(f"{base}/inter.csv", b"user_id,item_id,ts\nu,1,1\nu,2,2\nu,9,x\nu,3,3\n")
    fs.pipe(f"{base}/damaged/a.parquet", b"PAR1 not really parquet")
    yield base, PrivateBucket
    PrivateBucket.store.clear()


def _opts(*extra: str) -> list[str]:
    return [f"data.items.storage_options.token={TOKEN}", f"data.interactions.storage_options.token={TOKEN}", *extra]


def test_storage_options_open_a_private_bucket_and_no_secret_reaches_the_outputs(bucket, run_ingest):
    base, fs_cls = bucket
    r = run_ingest(f"{base}/items.csv", f"{base}/inter.csv", *_opts("data.min_seq_len=3"))
    r.check_accounting()
    assert r.facts["items_rows_ok"] == 3 and r.facts["interactions_rows_ok"] == 3
    assert TOKEN in fs_cls.opened_with  # the options went to the file system
    q = r.table("interactions_quarantine").to_pylist()
    assert [row["reason"] for row in q] == ["invalid_ts"]
    assert q[0]["source_file"] == "gtitest://***@bucket/inter.csv"
    for name in ("items", "interactions", "interactions_quarantine", "items_quarantine"):
        t = r.table(name)
        if "source_file" in t.column_names:
            assert not any(PASSWORD in (s or "") for s in t.column("source_file").to_pylist())


def test_without_storage_options_the_bucket_is_refused_in_one_line_without_the_password(bucket):
    base, _ = bucket
    with pytest.raises(DataError) as e:
        expand_paths(f"{base}/items.csv", "items")
    assert PASSWORD not in str(e.value) and "gtitest://***@bucket/items.csv" in str(e.value)


def test_redacted_option_values_are_not_passed_on(bucket):
    """A config read back from a run folder has `***redacted***` for its secrets: they are
    dropped (the caller overrides them), never sent as a credential."""
    base, _ = bucket
    with pytest.raises(DataError, match="cannot list"):
        expand_paths(f"{base}/items.csv", "items", {"token": REDACTED})
    assert expand_paths(f"{base}/items.csv", "items", {"token": TOKEN}) == [f"{base}/items.csv"]


def test_a_skipped_unreadable_file_is_recorded_without_the_password(bucket, run_ingest):
    base, _ = bucket
    with pytest.raises(DataError) as e:
        run_ingest(f"{base}/damaged", f"{base}/inter.csv", *_opts("data.on_unreadable_file=skip"))
    assert "all 1 file(s) are unreadable" in str(e.value) and PASSWORD not in str(e.value)


def test_read_tasks_carry_the_options_and_do_not_print_them(bucket):
    base, _ = bucket
    (task,) = plan_tasks([f"{base}/items.csv"], "auto", storage_options={"token": TOKEN})
    assert task.storage_options == {"token": TOKEN}
    assert TOKEN not in repr(task)
    fs, path = sources.filesystem(f"{base}/items.csv", {"token": TOKEN})
    assert fs.get_file_info(path).size > 0
