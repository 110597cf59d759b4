"""The `gti refresh` command: `refresh(run_dir, items, interactions, overrides)`, from the run to
`<run>/refresh/v<k>/`.

What it is for: the order of the steps (`run_steps`: `gti.refresh.ingest`, `.new_items`,
`.tokens`, `.train`, then `export_step` here) and what makes a refresh resumable and
traceable: the work folder `<run>/refresh/.v<k>.partial/`, kept for the same `fingerprint`;
each finished step recorded in `_steps.json`; the version's `_manifest.json` and `config.yaml`;
the new map added to `<run>/refresh/lineage/`; the folder published as `v<k>`. `cli_main` is
`gti refresh`. What a refresh does and writes: docs/refresh.md.

What it does not know: how a step reads, assigns or trains (the step modules do), Ray.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gti import config as C
from gti.config.io import redact
from gti.common.errors import ConfigError
from gti.run.input_files import fingerprint_files
from gti.run.manifest import MANIFEST_NAME, Manifest, stable_hash
from gti.common.files import atomic_write_bytes, atomic_write_json
from gti.refresh.ingest import ingest_step, split_cuts
from gti.refresh.attempt import (
    FINGERPRINT_FILE, GROWN_MODEL, RAY_DIR, STEPS_FILE, Job, Parent, RefreshError, RefreshResult, find_parent,
    load_run_config, log_default, read_manifest,
)
from gti.refresh.new_items import assign_step, embed_step, pairs_step
from gti.refresh.tokens import tokens_step
from gti.refresh.train import ground_step, sft_step
from gti.train.worker_config import FaultInjection

# In the fingerprint and the manifest: every section a step reads (model: the dtype the parent is
# loaded in; sid: assignment settings; init: how added code tokens start).
CONFIG_SECTIONS = ("data", "embed", "sid", "model", "init", "pairs", "ground", "sft", "refresh")
# Bumped whenever a step's code changes what it writes for the same inputs, so that a work folder
# begun by older code is emptied instead of resumed (2: a global_time run splits new rows by its
# recorded cuts; an attempt interrupted before that had split them leave-one-out).
WORK_FORMAT = 2


class Steps:
    """Finished steps of one attempt, kept in the work dir: {name: {"wall_s", "facts"}}."""

    def __init__(self, work: Path, log) -> None:
        self.path = work / STEPS_FILE
        self.log = log
        self.done: dict[str, dict] = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def run(self, name: str, fn: Callable[[], dict]) -> dict:
        if name in self.done:
            self.log(f"{name}: done by an interrupted attempt, reused")
            return self.done[name]["facts"]
        t0 = time.time()
        facts = fn()
        self.done[name] = {"wall_s": round(time.time() - t0, 3), "facts": facts}
        atomic_write_json(self.path, self.done)
        return facts

    def walls(self) -> dict[str, float]:
        return {k: v["wall_s"] for k, v in self.done.items()}


def _files_fingerprint(path: str | None, kind: str, storage_options=None) -> str | None:
    """The input files as ingest fingerprints them: local files by content, URIs (s3://, gs://,
    ...) by size and mtime from their file system, with the source's storage_options."""
    if path is None:
        return None
    return fingerprint_files(path, kind, storage_options)


def fingerprint(cfg: C.RunConfig, parent: Parent, items: str, interactions: str | None) -> str:
    """What a work folder may be reused for (`open_work`): the code's `WORK_FORMAT`, the parent
    map and base, the input files, the seed and the settings of `CONFIG_SECTIONS`."""
    dumped = cfg.model_dump(mode="json")
    d = cfg.data
    return stable_hash({
        "work_format": WORK_FORMAT,
        # base: a work folder begun before the run retrained is not reused.
        "parent": parent.hash, "base": parent.base,
        "items": _files_fingerprint(items, "items", d.items.storage_options),
        "interactions": _files_fingerprint(interactions, "interactions", d.interactions.storage_options),
        "seed": cfg.seed, **{s: dumped[s] for s in CONFIG_SECTIONS},
    })


def _lineage_with_base(run_dir: Path, sid_man: Manifest, cb_hash: str):
    """The run's lineage folder, holding the run's base map (so any later map can be traced
    back to it)."""
    from gti.run.versions import lineage_dir
    from gti.sid import versions as V

    lin = lineage_dir(run_dir)
    sf = sid_man.facts
    if lin.get(sf["sid_map_hash"]) is None:
        import pyarrow.parquet as pq

        base_table = pq.read_table(str(sid_man.output(run_dir / "sid", "sid_map")))
        lin.add(V.make_version(base_table, cb_hash, sf["codebook_sizes"], sf["token_format"], None,
                               note="base: the run's sid stage"), base_table)
    return lin


def open_work(work: Path, fp: str) -> None:
    """The work folder, kept when it was made for the same fingerprint, else emptied."""
    marker = work / FINGERPRINT_FILE
    if work.exists() and (not marker.is_file() or marker.read_text().strip() != fp):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(marker, fp.encode())


def refresh(run_dir: str | Path, items: str | Path, interactions: str | Path | None = None,
            overrides: Sequence[str] = (), *, log: Callable[[str], None] = log_default,
            fault_injection: FaultInjection | None = None, trust_remote_code: bool = False) -> RefreshResult:
    """Refresh the run in `run_dir` with the new items (docs/refresh.md).

    items / interactions: paths in any format `data.items.path` / `data.interactions.path` take
    (the run's column mapping and format apply; override them with `data.items.format=csv` etc.).
    overrides: key=value on the run's config (`refresh.*`, `ground.*`, `sft.*`, ...).
    trust_remote_code: the caller's `--trust-remote-code` (the run folder's config never sets it).
    fault_injection (tests): a `gti.train.worker_config.FaultInjection` for the grounding loop.
    Returns a RefreshResult; user mistakes raise GtiError subclasses (one line). Holds the run
    folder's writer lock (`gti.run.runlock`): a second refresh (or run) of the folder is refused.
    """
    from gti.run.runlock import RunLock

    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RefreshError(f"run directory not found: {run_dir}")
    with RunLock(run_dir):
        return _refresh_locked(run_dir, items, interactions, overrides, log, fault_injection, trust_remote_code)


def _refresh_locked(run_dir: Path, items, interactions, overrides: Sequence[str], log: Callable[[str], None],
                    fault_injection: FaultInjection | None, trust_remote_code: bool = False) -> RefreshResult:
    from gti.run.versions import next_version, refresh_root
    from gti.sid import versions as V

    t_start = time.time()
    items_s, inter_s = str(items), None if interactions is None else str(interactions)
    cfg = load_run_config(run_dir, items_s, inter_s, overrides, trust_remote_code, note=log)
    if cfg.refresh.sft_steps > 0 and interactions is None:
        raise ConfigError("refresh.sft_steps > 0 needs --interactions (the SFT pass trains on them)")
    if interactions is not None:
        split_cuts(run_dir, cfg.data)  # a split refresh cannot repeat is refused before any work
    parent = find_parent(run_dir, note=log)  # skips versions made on another base, one line each
    sid_man = read_manifest(run_dir, "sid")
    cb_hash = V.codebooks_hash(sid_man.output(run_dir / "sid", "codebooks"))
    lin = _lineage_with_base(run_dir, sid_man, cb_hash)
    k = next_version(run_dir)  # after every published v<k>, skipped ones included
    work = refresh_root(run_dir) / f".v{k}.partial"
    fp = fingerprint(cfg, parent, items_s, inter_s)
    open_work(work, fp)
    log(f"v{k} of {run_dir} (parent map {parent.hash}, model {parent.model_dir})")
    steps = Steps(work, log)
    job = Job(run_dir, cfg, parent, work, k, sid_man.facts, cb_hash, log, interactions is not None)
    done = run_steps(steps, job, fault_injection)
    version = V.read_version(work / "sid" / "sid_map.parquet")
    facts = _facts(job, version, done, steps, t_start)
    _write_record(job, fp, facts, {"parent": parent.hash, "items": str(items), "interactions": str(interactions)})
    final = _publish(job, lin, version)
    log(f"v{k}: {facts['assigned']} new items, map {parent.hash} -> {version.hash}; "
        f"ground {facts['steps']['ground']} steps, sft {facts['steps']['sft']} steps; "
        f"{facts['total_wall_s']:.1f}s -> {final}")
    return RefreshResult(k=k, dir=final, parent_hash=parent.hash, new_hash=version.hash, facts=facts)


def run_steps(steps: Steps, job: Job, fault_injection: FaultInjection | None = None) -> dict[str, dict]:
    """{step name: its facts}, in order; a step an interrupted attempt finished is reused."""
    return {
        "ingest": steps.run("ingest", lambda: ingest_step(job)),
        "embed": steps.run("embed", lambda: embed_step(job)),
        "assign": steps.run("assign", lambda: assign_step(job)),
        "tokens": steps.run("tokens", lambda: tokens_step(job)),
        "pairs": steps.run("pairs", lambda: pairs_step(job)),
        "ground": steps.run("ground", lambda: ground_step(job, fault_injection)),
        "sft": steps.run("sft", lambda: sft_step(job)),
        "export": steps.run("export", lambda: export_step(job)),
    }


def _facts(job: Job, version, done: dict[str, dict], steps: Steps, t_start: float) -> dict[str, Any]:
    f_assign = done["assign"]
    return {
        "version": job.k,
        "parent_hash": job.parent.hash,
        "new_hash": version.hash,
        "parent_version": job.parent.k,
        "parent_model": str(job.parent.model_dir),
        "base": job.parent.base,  # gti.run.versions.BASE_FACT: which base the version belongs to
        "assigned": f_assign["assigned"],
        "already_present": f_assign["already_present"],
        "prefix_changed": f_assign["prefix_changed"],
        "full_groups": f_assign["needs_new_tokens"],
        "codebook_sizes": list(version.codebook_sizes),
        "added_tokens": f_assign.get("added_tokens", []),
        "n_items": version.n_items,
        **{name: f for name, f in done.items() if name != "assign"},  # assign's facts are the counts above
        "steps": {"ground": done["ground"].get("steps_done", 0), "sft": done["sft"].get("steps_done", 0)},
        "wall_s": steps.walls(),
        "total_wall_s": round(time.time() - t_start, 3),
    }


def _write_record(job: Job, fp: str, facts: dict, inputs: dict) -> None:
    """`_manifest.json` (facts, `_facts`: parent and new hash, counts, the new map's
    `codebook_sizes` and `added_tokens`, steps, wall time of each step) and `config.yaml` (the
    config the refresh ran with) of the version, in the work folder."""
    work, cfg = job.work, job.cfg
    outputs = {"sid_map": "sid/sid_map.parquet", "sid_map_version": "sid/sid_map.version.json",
               "model": "model", "items": "ingest/items.parquet",
               "items_quarantine": "ingest/items_quarantine.parquet", "pairs_new": "pairs_new.parquet"}
    for name in ("interactions", "interactions_quarantine", "sequences"):
        if (work / "ingest" / f"{name}.parquet").is_file():
            outputs[name] = f"ingest/{name}.parquet"
    red = redact(cfg.model_dump(mode="json"))
    Manifest(stage="refresh", fingerprint=fp, config={"seed": cfg.seed, **{s: red[s] for s in CONFIG_SECTIONS}},
             inputs=inputs, facts=facts, outputs=outputs, duration_s=facts["total_wall_s"]).write(work)
    atomic_write_bytes(work / "config.yaml", C.dump(cfg).encode())


def _publish(job: Job, lin, version) -> Path:
    """The new map into the lineage, the work folder renamed to `v<k>` (returned)."""
    import pyarrow.parquet as pq

    work = job.work
    final = work.parent / f"v{job.k}"
    if (final / MANIFEST_NAME).is_file():  # a published version is never replaced
        raise RefreshError(f"{final} is already a published version (it has a {MANIFEST_NAME}); "
                           f"not replacing it: the work folder {work} is kept")
    lin.add(version, pq.read_table(str(work / "sid" / "sid_map.parquet")))
    shutil.rmtree(work / RAY_DIR, ignore_errors=True)
    if final.exists():  # a finished folder without a manifest (never listed as a version)
        shutil.rmtree(final)
    work.rename(final)
    # Only after the rename: a kill before it leaves the work folder with its marker, so the
    # rerun keeps every finished step instead of emptying the folder.
    (final / FINGERPRINT_FILE).unlink(missing_ok=True)
    return final


# Which model a refresh publishes, best first: the one trained furthest.
_SOURCE_RANK = {"sft": 0, "ground": 1, "parent_with_added_tokens": 2, "parent": 3}


def _place_model(job: Job) -> str:
    """`<work>/model/`: the SFT model, else the grounded one, else the parent's with the added
    code tokens (`grown_model/`), else a copy of the parent's; returns which (a rerun after an
    interrupted export reads it from `.refresh_source`)."""
    final = job.work / "model"
    cands = [(c, st) for c, st in ((job.work / "sft_model", "sft"), (job.work / "ground_model", "ground"),
                                   (job.work / GROWN_MODEL, "parent_with_added_tokens"))
             if (c / "config.json").is_file()]
    placed = (final / ".refresh_source").read_text().strip() \
        if (final / "config.json").is_file() and (final / ".refresh_source").is_file() else None
    if placed in _SOURCE_RANK and (not cands or _SOURCE_RANK[placed] <= _SOURCE_RANK[cands[0][1]]):
        # An interrupted export already moved the best model there (e.g. the SFT model, with the
        # grounded one still beside it): keep it, never replace it with a lesser one.
        return placed
    if cands:
        if final.exists():
            shutil.rmtree(final)
        source = cands[0][1]
        if source != "parent_with_added_tokens":  # first: a rerun must never pick it over a trained model
            shutil.rmtree(job.work / GROWN_MODEL, ignore_errors=True)
        (cands[0][0] / ".refresh_source").write_text(source)  # before the move: a rerun knows it
        cands[0][0].rename(final)
    else:
        if tuple(job.map_facts()["codebook_sizes"]) != tuple(job.parent.codebook_sizes):
            raise RefreshError(f"export: the new map adds code tokens but {job.work / GROWN_MODEL} (the parent's "
                               f"model with them) is missing; remove {job.work} and rerun the refresh")
        if final.exists():
            shutil.rmtree(final)
        tmp = job.work / ".model.copy"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(job.parent.model_dir, tmp)
        source = "parent"
        (tmp / ".refresh_source").write_text(source)
        tmp.rename(final)
    return source


def export_step(job: Job) -> dict:
    """Step 8: `model/` (`_place_model`) with its `gti_meta.json` naming the new map
    (`sid_map_hash`), its parent (`sid_map_parent`), its version record (`sid_map_version`) and
    its `codebook_sizes`; `new_token_ids` there covers any added code tokens."""
    from gti.lm.new_rows import META_NAME
    from gti.sid import versions as V

    source = _place_model(job)
    version = V.read_version(job.work / "sid" / "sid_map.parquet")
    meta_path = job.work / "model" / META_NAME
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    meta.update({"stage": "refresh", "refresh_version": job.k, "sid_map_hash": version.hash,
                 "sid_map_parent": job.parent.hash, "sid_map_version": version.to_dict(),
                 "codebook_sizes": list(version.codebook_sizes),
                 "refreshed_from": str(job.parent.model_dir), "refresh_model_source": source})
    atomic_write_bytes(meta_path, json.dumps(meta, indent=2, sort_keys=True, default=str).encode())
    for f in ("e_new_start.safetensors", "val_source.parquet"):
        (job.work / f).unlink(missing_ok=True)
    return {"model_source": source}


def cli_main(args) -> int:
    """`gti refresh --run-dir R --items NEW [--interactions NEW] [key=value ...]`."""
    res = refresh(args.run_dir, args.items, args.interactions, getattr(args, "overrides", None) or [],
                  trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    f = res.facts
    added = f" (+{len(f['added_tokens'])} SID tokens)" if f.get("added_tokens") else ""
    print(f"refresh v{res.k}: {f['assigned']} new items assigned ({f['already_present']} already present), "
          f"SID map {res.parent_hash} -> {res.new_hash}{added}; ground {f['steps']['ground']} steps, "
          f"sft {f['steps']['sft']} steps; {f['total_wall_s']:.0f}s; model: {res.model_dir}")
    return 0
