"""`gti infer`, the part without Ray: which users, cut into which parts, written how, resumed how.

What it is for: `plan_job` turns `--users all|FILE`, `--k`, `--version` into an `InferJob` (the
users, the parts, the version that answers, the job's key); `decode_part` answers one part with a
`RecommenderService` (the decode of `gti serve` and `gti recommend`); `write_part` writes it
atomically; `finished_parts` and `prepare_out` resume a job only onto its own parts (a rerun
whose key differs is refused with one line naming what changed; `--force` replaces them). The
output folder holds `part-<i:05d>.parquet` files of `OUT_SCHEMA` rows, in input order, and
`_gti_infer.json`; parquet readers read it as one table.

What it does NOT know: Ray (`gti.serve.infer_ray` runs the parts on a Ray Data actor pool) or
how a history is decoded (`gti.serve.service`).
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from gti.common.errors import ConfigError, DataError, GtiError, one_line
from gti.common.files import atomic_write_bytes, atomic_write_json
from gti.run.runlock import LOCK_FILE

MANIFEST = "_gti_infer.json"
PART_ROWS = 4096  # users per part: what a kill can lose, and one actor call
# A part's rows: user_id, item_ids best first (<= k), sids, scores = sum of the SID tokens'
# log-probs, history_used, error (null, or why the user got no items). `MANIFEST` records the run,
# version, model, map hash, k and the users' hash. Parquet readers skip files starting with `.`
# or `_` (the temps, lock and manifest).
OUT_SCHEMA = pa.schema([("user_id", pa.string()), ("item_ids", pa.list_(pa.string())),
                        ("sids", pa.list_(pa.string())), ("scores", pa.list_(pa.float32())),
                        ("history_used", pa.int32()), ("error", pa.string())])
_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl",
            ".ndjson": "jsonl"}


class InferOutputError(GtiError):
    """--out cannot take this job's parts (a file, another folder, another job's parts)."""


def part_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


@dataclass(frozen=True)
class Part:
    """Users [start, stop) of the job, written to `part_name(index)`."""

    index: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def plan_parts(n_rows: int, part_rows: int) -> list[Part]:
    """Consecutive parts of at most `part_rows` users over range(n_rows)."""
    if part_rows < 1:
        raise ConfigError(f"--part-rows must be >= 1, got {part_rows}")
    return [Part(i, s, min(n_rows, s + part_rows)) for i, s in enumerate(range(0, n_rows, part_rows))]


# --------------------------------------------------------------------------- users
def run_sequences(run_dir: Path, version: int) -> tuple[pl.DataFrame, Path]:
    """(user_id, history) of every user of the run's sequences, whole sequence oldest first:
    the newest refresh version <= `version` that wrote sequences, else the ingest stage's."""
    from gti.run.manifest import MANIFEST_NAME, Manifest
    from gti.run.versions import current_versions

    # Only versions made on the run's current base (a retrained run's old versions are not its).
    cands = [v.sequences_path for v in reversed(current_versions(run_dir, note=lambda line: None))
             if v.k <= version]
    ingest = run_dir / "ingest"
    if (ingest / MANIFEST_NAME).is_file() and "sequences" in Manifest.read(ingest).outputs:
        cands.append(Manifest.read(ingest).output(ingest, "sequences"))
    path = next((p for p in cands if p.is_file()), None)
    if path is None:
        raise DataError(f"{run_dir}: no ingest sequences to take the users from; "
                        "give --users FILE with user_id and history columns")
    from gti.data.sequences import split_lists

    # The period lists: one item each under leave-one-out, every valid/test-period item under
    # the global time split (where valid_item / test_item are null).
    seqs = split_lists(pl.read_parquet(path))
    hist = pl.concat_list(pl.col("train_items"), pl.col("valid_items"), pl.col("test_items")).list.drop_nulls()
    return seqs.select(pl.col("user_id").cast(pl.Utf8), history=hist), path


def _read_file(path: Path, spec: str) -> pl.DataFrame:
    fmt = "parquet" if path.is_dir() else _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"--users {spec}: unknown format '{path.suffix}'; give a .parquet, .csv, .tsv or "
                        ".jsonl file with a user_id column (and optionally history)")
    try:
        if fmt == "parquet":
            return pl.read_parquet(path / "*.parquet" if path.is_dir() else path)
        if fmt == "jsonl":
            return pl.read_ndjson(path)
        return pl.read_csv(path, separator="\t" if fmt == "tsv" else ",", infer_schema=False)
    except Exception as err:  # noqa: BLE001 - polars/arrow raise many kinds; all mean "not readable"
        raise DataError(f"--users {spec}: cannot read it as {fmt}: {one_line(str(err))}") from None


def _history_column(frame: pl.DataFrame, spec: str) -> pl.Expr:
    dtype = frame.schema["history"]
    if isinstance(dtype, pl.List):
        return pl.col("history").cast(pl.List(pl.Utf8)).list.eval(pl.element().str.strip_chars())
    if dtype == pl.Utf8:
        return pl.col("history").fill_null("").str.split(",").list.eval(pl.element().str.strip_chars())
    raise DataError(f"--users {spec}: column 'history' is {dtype}; expected a list of item ids "
                    "or a comma-separated string of them, oldest first")


def read_users(spec: str, run_dir: Path, version: int) -> tuple[pl.DataFrame, str]:
    """(user_id str, history list<str> oldest first) per input row, in input order, and the
    source named in the manifest. `spec`: "all" (the run's sequences) or a parquet, CSV, TSV or
    JSONL file with `user_id` and optionally `history` (else taken from the run's sequences; a
    user not in them gets an empty history, i.e. an error row). One-line DataError otherwise."""
    if spec == "all":
        users, path = run_sequences(run_dir, version)
        return users, f"all ({path})"
    path = Path(spec).expanduser()
    if not path.exists():
        raise DataError(f"--users {spec}: no such file (give 'all' or a file with a user_id column)")
    frame = _read_file(path, spec)
    if "user_id" not in frame.columns:
        raise DataError(f"--users {spec}: no 'user_id' column (it has: {', '.join(frame.columns[:12]) or 'none'}); "
                        "expected user_id and optionally history")
    n_null = frame["user_id"].null_count()
    if n_null:
        raise DataError(f"--users {spec}: {n_null} row(s) without a user_id")
    if frame.height == 0:
        raise DataError(f"--users {spec}: no rows")
    try:
        ids = frame.select(pl.col("user_id").cast(pl.Utf8))
        if "history" in frame.columns:
            hist = frame.select(history=_history_column(frame, spec))
        else:
            seqs, _ = run_sequences(run_dir, version)
            hist = ids.join(seqs.unique("user_id", keep="first"), on="user_id", how="left",
                            maintain_order="left").select(pl.col("history").fill_null([]))
    except pl.exceptions.PolarsError as err:
        raise DataError(f"--users {spec}: {one_line(str(err))}") from None
    hist = hist.select(pl.col("history").list.eval(pl.element().filter(pl.element().str.len_chars() > 0)))
    return pl.concat([ids, hist], how="horizontal"), str(path.resolve())


def users_hash(users: pl.DataFrame, chunk: int = 100_000) -> str:
    """sha256 of the users and their histories in order (the same input gives the same hash)."""
    h = hashlib.sha256()
    for part in users.iter_slices(chunk):
        text = part.select(pl.concat_str([pl.col("user_id"), pl.col("history").list.join("\x1f")],
                                         separator="\x1e"))
        h.update(("\n".join(text.to_series().to_list()) + "\n").encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- the job
@dataclass
class InferJob:
    """What one `gti infer` decodes and where; `key` is what a resumed job must match.

    `users`: user_id, history list<str> oldest first, in input order; part i = users
    [i * part_rows, (i + 1) * part_rows). The key holds everything a row depends on: the
    version, the model stage AND its fingerprint (`model_fingerprint`: a model retrained on the
    same map is another model), the map hash, k, the beam width, history exclusion and length,
    the users and how they are cut; never resumed onto parts another model or setting wrote.
    """

    run_dir: Path
    out: Path
    users: pl.DataFrame  # user_id str, history list<str>
    parts: list[Part]
    key: dict[str, Any]
    eval_cfg: Any  # the run's eval section: concurrency, num_gpus, cpu_threads

    @property
    def version(self) -> int:
        return int(self.key["version"])


def model_identity(run_dir: Path, version: int | None) -> tuple[int, str, str, int]:
    """(version k, model stage, map hash, catalog size) of what `LoadedRun.open` would load."""
    from gti.run.versions import resolve

    at = resolve(run_dir, version)
    return at.k, at.stage, at.map_hash, pq.read_metadata(at.map_path).num_rows


def model_fingerprint(run_dir: Path, stage: str) -> dict[str, Any]:
    """Which model `stage` ("sft", "refresh/v<k>") of `run_dir` is: its manifest's fingerprint
    and creation time. The stage name and map hash do not say it: `gti run --from sft` with new
    settings (the same map) retrains the model under both, and `gti run --force` retrains with
    the same fingerprint (the time differs). Without a manifest fingerprint, the model folder's
    files stand for it (`file_fingerprint`: small files by content, weights by size and mtime)."""
    import json

    from gti.run.manifest import MANIFEST_NAME, file_fingerprint

    stage_dir = run_dir / stage
    try:
        raw = json.loads((stage_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        raw = {}
    fp, created = raw.get("fingerprint"), raw.get("created")
    if not fp:
        model_dir = stage_dir / "model"
        fp = f"files:{file_fingerprint(model_dir)}" if model_dir.is_dir() else None
    return {"model_fingerprint": fp, "model_created": created}


def plan_job(run_dir: str | Path, users: str, out: str | Path, *, k: int, version: int | None = None,
             exclude_history: bool = False, part_rows: int | None = None,
             batch_users: int | None = None) -> InferJob:
    """Read the users and fix everything a resumed job must repeat (`InferJob.key`); one-line
    errors for a missing run or version, a k above the catalog, a bad users file."""
    from gti.run.loaded import run_config
    from gti.run.versions import RunDirError

    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    v, stage, map_hash, n_catalog = model_identity(run_dir, version)
    if k > n_catalog:
        raise ConfigError(f"--k {k} exceeds the catalog of version {v} ({n_catalog} items)")
    run_cfg = run_config(run_dir, stage)
    ec = run_cfg.eval
    frame, source = read_users(users, run_dir, v)
    part_rows = PART_ROWS if part_rows is None else int(part_rows)
    batch_users = run_cfg.serve.infer_batch_users if batch_users is None else int(batch_users)
    if batch_users < 1:
        raise ConfigError(f"--batch-users must be >= 1, got {batch_users}")
    # Everything a part's rows depend on: the model (not only its stage's name), the map, the
    # decode settings and the users. A part is taken as done only under an equal key.
    key = {"run_dir": str(run_dir), "version": v, "model": stage, **model_fingerprint(run_dir, stage),
           "map_hash": map_hash, "k": int(k), "exclude_history": bool(exclude_history),
           "beam_width": int(ec.beam_width), "max_history": int(run_cfg.data.max_history), "users": source,
           "users_sha256": users_hash(frame), "n_users": frame.height, "part_rows": part_rows,
           "batch_users": batch_users}
    return InferJob(run_dir, Path(out).expanduser().resolve(), frame, plan_parts(frame.height, part_rows), key, ec)


# --------------------------------------------------------------------------- the output folder
def _ours(out: Path) -> list[Path]:
    return [*out.glob("part-*.parquet"), *out.glob(".part-*.tmp"), out / MANIFEST]


def prepare_out(out: Path, key: dict[str, Any], force: bool = False) -> dict[str, Any] | None:
    """Make `out` ready for the job `key` (call it holding `RunLock(out)`): a new folder, or one
    holding this same job's parts (resumed), or, with `force`, another job's (its parts removed).
    Leftover temps are removed. Returns the earlier manifest when resuming, else None."""
    if out.exists() and not out.is_dir():
        raise InferOutputError(f"--out {out} is a file; gti infer writes a folder of parquet parts")
    old = read_manifest(out)
    if old is None:
        other = [p.name for p in out.iterdir() if p.name != LOCK_FILE] if out.is_dir() else []
        if other:
            raise InferOutputError(f"--out {out} holds files that are not a gti infer output ({', '.join(other[:5])}); "
                                   "give a new or empty folder")
    elif old.get("key") != key:
        diff = [f"{n}: {old.get('key', {}).get(n)!r} -> {key[n]!r}" for n in key
                if old.get("key", {}).get(n) != key[n]]
        if not force:
            raise InferOutputError(f"--out {out} holds the parts of another gti infer job ({'; '.join(diff[:4])}); "
                                   "use a new --out, or --force to replace them")
        for p in _ours(out):
            p.unlink(missing_ok=True)
        old = None
    for tmp in out.glob(".part-*.tmp"):  # a killed writer's: never read, never a part
        tmp.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / MANIFEST, {**(old or {}), "tool": "gti infer", "state": "running", "key": key,
                                       "started": round(time.time(), 1)})
    return old


def read_manifest(out: Path) -> dict[str, Any] | None:
    import json

    try:
        return json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise InferOutputError(f"{out / MANIFEST}: unreadable ({one_line(str(err))}); use --force") from None


def finish_manifest(out: Path, key: dict[str, Any], parts: Sequence[Part], facts: dict[str, Any]) -> None:
    """Mark the job complete: every part named, with the run's version, model and map hash."""
    old = read_manifest(out) or {}
    atomic_write_json(out / MANIFEST, {**old, "state": "complete", "key": key, "finished": round(time.time(), 1),
                                       "parts": [part_name(p.index) for p in parts],
                                       "columns": OUT_SCHEMA.names, **facts})


def finished_parts(out: Path, users: pl.DataFrame, parts: Sequence[Part]) -> set[int]:
    """Indexes of the parts already in `out`: a file that reads back holding exactly the plan's
    user ids for it. Temps, unreadable files and another plan's parts are not done."""
    done = set()
    for p in parts:
        path = out / part_name(p.index)
        if not path.is_file():
            continue
        try:
            got = pq.read_table(path, columns=["user_id"]).column("user_id").to_pylist()
        except (OSError, pa.ArrowException):
            continue
        if got == users["user_id"].slice(p.start, p.rows).to_list():
            done.add(p.index)
    return done


def write_part(out: Path, index: int, table: pa.Table) -> Path:
    """Write part `index` atomically: readers see no file or the whole part."""
    buf = io.BytesIO()
    pq.write_table(table.cast(OUT_SCHEMA), buf)
    path = out / part_name(index)
    atomic_write_bytes(path, buf.getvalue())  # temp: .part-<i>.parquet.<random>.tmp in `out`
    return path


def read_output(out: str | Path) -> pa.Table:
    """Every part of `out` in part order, as one table (what a parquet reader of the folder gives)."""
    paths = sorted(Path(out).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p).cast(OUT_SCHEMA) for p in paths]) if paths else OUT_SCHEMA.empty_table()


# --------------------------------------------------------------------------- decoding a part
def decode_part(service: Any, user_ids: Sequence[str], histories: Sequence[Sequence[str]], *, k: int,
                exclude_history: bool, batch_users: int) -> pa.Table:
    """One part's rows (`OUT_SCHEMA`, input order): `service.answer` on consecutive sub-batches
    of `batch_users` histories from the part's start (always the same ones, so a part decodes
    the same whether or not the job was resumed), unknown ids ignored; a user with no known
    history gets no items and the reason in `error`."""
    from gti.serve.service import Query, RequestError

    cols: dict[str, list] = {name: [] for name in OUT_SCHEMA.names}
    for start in range(0, len(user_ids), max(1, batch_users)):
        stop = start + max(1, batch_users)
        queries = [Query(tuple(h), k, exclude_history, "ignore") for h in histories[start:stop]]
        for uid, ans in zip(user_ids[start:stop], service.answer(queries)):
            items = [] if isinstance(ans, RequestError) else ans["items"]
            cols["user_id"].append(uid)
            cols["item_ids"].append([r["item_id"] for r in items])
            cols["sids"].append([r["sid"] for r in items])
            cols["scores"].append([r["score"] for r in items])
            cols["history_used"].append(0 if isinstance(ans, RequestError) else ans["history_used"])
            cols["error"].append(ans.message if isinstance(ans, RequestError) else None)
    return pa.table(cols, schema=OUT_SCHEMA)
