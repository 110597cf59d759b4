"""Input sources read into validated batches, in this process: the reading half of ingest.

What it is for: the ingest stage (on Ray Data) and `gti refresh` (in process) read the user's
files the same way, with this module: `Source` plans one source before any row is read;
`validated_batches` turns read tasks into validated pyarrow batches (`gti.data.catalog` row
checks), a file-level user error becoming one marker row a Ray task can return
(`raise_file_error` raises for it on the driver); `local_stream` / `iterate` run them here;
`fill_item_raw` / `fill_interaction_raw` give a raw JSON copy to rows quarantined later.

What it does not know: Ray, the config classes (any object with the attributes used here
works), duplicate ids, caps, unknown items or output files: the callers decide those.
"""

from __future__ import annotations

from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from gti.data import adapters
from gti.data.sources import READ_ERRORS, ReadTask, error_reason, expand_paths, plan_tasks
from gti.data import catalog as cat
from gti.common.errors import DataError, GtiError, UnreadableFileError
from gti.common.redact import redact_text

FILE_ERROR = "__file_error__"  # marker row: a reader failed on a whole file (see validated_batches)
UNREADABLE_FILE = "__unreadable_file__"  # marker row: the same, for a file that may be skipped
BATCH_ROWS = 8192


def validated_batches(tasks: list[ReadTask], kind: str, columns, max_text_chars: int,
                      batch_rows: int = BATCH_ROWS) -> Iterator[pa.Table]:
    """Read + row-check `tasks` in order. `columns`: the source's column mapping (an
    `ItemColumns` / `InteractionColumns`). A file-level user error ends the stream with one
    marker row naming the file (reason FILE_ERROR, or UNREADABLE_FILE with the reader's error)."""
    schema = cat.ITEM_BATCH_SCHEMA if kind == "items" else cat.INTERACTION_BATCH_SCHEMA
    for task in tasks:
        shown = redact_text(task.file)  # every row's source_file: no credentials of a URI
        try:
            try:
                for raw, first_row in adapters.iter_task(task, kind, columns, batch_rows):
                    if kind == "items":
                        yield cat.validate_items(raw, columns.attributes, max_text_chars, shown, first_row)
                    else:
                        has_ts = columns.ts is not None or task.fmt == "movielens"
                        yield cat.validate_interactions(raw, has_ts, shown, first_row)
            except READ_ERRORS as err:  # a reader path that did not name the file itself
                raise UnreadableFileError(task.file, f"cannot read: {error_reason(err)}") from None
        except GtiError as err:
            # A file-level user error travels as a marker row rather than a task failure, so the
            # user sees our one line instead of Ray's retry notes and task traceback.
            row = {f.name: None for f in schema}
            unreadable = isinstance(err, UnreadableFileError)
            row.update(reason=UNREADABLE_FILE if unreadable else FILE_ERROR, detail=str(err).splitlines()[0],
                       source_file=task.file, raw=err.what if unreadable else None)
            yield pa.Table.from_pylist([row], schema=schema)
            return


def local_stream(tasks: list[ReadTask], kind: str, columns, max_text_chars: int, parallelism=None):
    """The validated batches of all tasks, in input order, computed in this process (the same
    batches as the ingest stage's `ray_stream`; for `gti refresh`, tests and debugging a bad
    file without Ray). `parallelism` is ignored (the signature of a stream)."""
    for t in tasks:
        yield from validated_batches([t], kind, columns, max_text_chars, BATCH_ROWS)


def iterate(stream, tasks, kind, columns, max_text_chars, parallelism):
    """`stream(tasks, ...)` (a generator), closed when the caller stops early or fails, so Ray
    Data stops its read tasks at once instead of when the generator is collected."""
    it = stream(tasks, kind, columns, max_text_chars, parallelism)
    try:
        yield from it
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class SkipFile(Exception):
    """A read task found `file` unreadable under data.on_unreadable_file=skip: the pass over
    its source starts again without it."""

    def __init__(self, file: str, what: str) -> None:
        super().__init__(f"{file}: {what}")
        self.file, self.what = file, what


def raise_file_error(batch: pa.Table, skip: bool = False) -> None:
    """Raise for a marker row of `validated_batches` (DataError, UnreadableFileError, or
    SkipFile when `skip`). It may sit anywhere in the batch: Ray Data merges a task's small
    outputs into one block, so it can follow the file's earlier rows."""
    marks = pc.is_in(batch.column("reason"), pa.array([FILE_ERROR, UNREADABLE_FILE]))
    if not pc.any(marks).as_py():
        return
    i = int(pc.index(marks, True).as_py())
    reason = batch.column("reason")[i].as_py()
    if reason == FILE_ERROR:
        raise DataError(batch.column("detail")[i].as_py())
    file, what = batch.column("source_file")[i].as_py(), batch.column("raw")[i].as_py()
    raise SkipFile(file, what) if skip else UnreadableFileError(file, what)


class Source:
    """One input source (items or interactions) planned before any work: its files, read
    tasks, the optional columns it lacks, and the files skipped as unreadable.

    data: the `data` config section (`items` / `interactions` with path, format, columns;
    `on_unreadable_file`); log: one line per skipped file. Read tasks come from
    `gti.data.sources.plan_tasks`, the missing optional columns from a header check; files are
    left out as unreadable under `data.on_unreadable_file: skip`. `passes(body)` reruns a pass
    over the source without each file found unreadable mid-read (`SkipFile`)."""

    def __init__(self, data, kind: str, log: Callable[[str], None]) -> None:
        self.kind, self.log = kind, log
        self.src = data.items if kind == "items" else data.interactions
        self.skip = data.on_unreadable_file == "skip"
        opts = getattr(self.src, "storage_options", None) or {}
        self.files = expand_paths(self.src.path, kind, opts)
        self.tasks: list[ReadTask] = []
        self.skipped: list[dict[str, str]] = []
        missing: set[str] = set()
        for f in self.files:
            try:
                tasks = plan_tasks([f], self.src.format, storage_options=opts)
                # Header/schema checks here, so a wrong column fails before Ray starts work.
                missing.update(adapters.check_header(tasks[0], kind, self.src.columns) if tasks else [])
            except UnreadableFileError as err:
                if not self.skip:
                    raise
                self._record(err.file, err.what)
                continue
            self.tasks += tasks
        self.missing_columns = sorted(missing)
        self._check_left()

    def _record(self, file: str, what: str) -> None:
        file, what = redact_text(file), redact_text(what)  # facts.skipped_files and the log line
        self.skipped.append({"file": file, "reason": what})
        self.log(f"WARNING: {self.kind}: skipped unreadable file {file}: {what} "
                 "(data.on_unreadable_file: skip)")

    def _check_left(self) -> None:
        if not self.tasks:
            first = self.skipped[0] if self.skipped else {"file": self.src.path, "reason": "no files"}
            raise DataError(redact_text(
                f"data.{self.kind}.path {self.src.path}: all {len(self.files)} file(s) are "
                f"unreadable (first: {first['file']}: {first['reason']})"))

    def drop(self, skip: SkipFile) -> None:
        """Leave out a file a read task found unreadable (skip mode); the pass restarts."""
        self._record(skip.file, skip.what)
        self.tasks = [t for t in self.tasks if t.file != skip.file]
        self._check_left()

    def passes(self, body):
        """body(tasks) -> result, rerun without each file it finds unreadable (skip mode)."""
        for _ in range(len(self.files) + 1):
            try:
                return body(self.tasks)
            except SkipFile as skip:
                self.drop(skip)
                self.log(f"{self.kind}: reading again without {redact_text(skip.file)}")
        raise RuntimeError(f"{self.kind}: more restarts than files")  # each pass drops one file


def _fill_raw(bad: pa.Table, columns: tuple[str, ...]) -> pa.Table:
    raw = bad.column("raw").to_pylist()
    if all(r is not None for r in raw):
        return bad
    cols = {c: bad.column(c).to_pylist() for c in columns}
    for i, r in enumerate(raw):
        if r is None:
            raw[i] = cat.raw_json({c: cols[c][i] for c in cols})
    return bad.set_column(bad.schema.get_field_index("raw"), "raw", pa.array(raw, pa.string()))


def fill_item_raw(bad: pa.Table) -> pa.Table:
    """Quarantined item rows with a raw JSON copy (duplicates passed the row check, so they
    have none yet)."""
    return _fill_raw(bad, ("item_id", "title", "description", "category", "attributes_text"))


def fill_interaction_raw(bad: pa.Table) -> pa.Table:
    """Quarantined interaction rows with a raw JSON copy (unknown items passed the row check)."""
    return _fill_raw(bad, ("user_id", "item_id", "ts"))
