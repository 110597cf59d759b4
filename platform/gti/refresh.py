"""`gti refresh`: new items onto a trained run, without retraining it (issue 15, item 1).

What it is for: a catalog gains items after a run has trained. `refresh(run_dir, items,
interactions)` gives them SIDs made of the run's existing code tokens, teaches the model what
they mean with a short grounding pass, and writes a new SID-map version that descends from the
run's (so evaluation and `gti recommend` accept it for the old model as well as for the new):

1. ingest: the new items (and optional new interactions) are read and validated with the
   ingest stage's own readers and row checks (`gti.stages.ingest`: same formats, same column
   mapping `data.items.*` / `data.interactions.*`, overridable with key=value). Bad rows go to
   `ingest/items_quarantine.parquet` / `interactions_quarantine.parquet` with their reason,
   file and row; an interaction naming an item that is neither in the run's map nor new is
   `unknown_item`. New interactions are merged with the parent's (each user's history in time
   order) into `ingest/sequences.parquet` (leave-one-out, as ingest splits). `data.max_items`
   and `data.max_users` do not apply to a refresh.
2. embed: the run's encoder (`embed` section; `gti.embed.encoders`), in this process.
3. assign: the run's frozen quantiser (`<run>/sid/quantizer.*`, `gti.sid.quantizer.load_quantizer`)
   gives the codes; `gti.sid.versions.assign_new_items` resolves collisions against the parent
   map without changing any existing SID (the de-duplication level takes the smallest free
   code of the prefix group). Items that would need a new token (a full prefix group) are
   listed in `needs_new_tokens.json` and the refresh stops with one line
   (`refresh.on_full_group: error`, the only value implemented). The new map is written with
   its version record (parent hash) and added to `<run>/refresh/lineage/`.
4. pairs: the new items' grounding pairs (the pairs stage's renderer, same templates and
   tokenizer), plus `refresh.replay_ratio` x as many old training pairs (seeded sample of the
   run's pairs and earlier refreshes' new pairs).
5. ground: `refresh.ground_steps` steps of the grounding task on Ray Train + DeepSpeed
   (`gti.train.loop.fit`, the grounding hooks: backbone and every non-SID row frozen, only the
   SID rows train), continuing from the parent's model (the latest refresh's, else
   `<run>/sft/model`, else `<run>/ground/model`). Validation: constrained text->SID exact match
   on the new items (held-out pairs when the split has them, else in-sample).
6. sft (optional, `refresh.sft_steps` > 0, needs `--interactions`): the SFT task on the
   training windows of the users the new interactions touch.
7. export: `model/` (standard HF folder; `gti_meta.json` records `sid_map_hash` = the new map,
   `sid_map_parent`, `sid_map_version`), `_manifest.json` (facts: parent and new hash, counts,
   steps, wall time of each step) and `config.yaml`.

Output: `<run>/refresh/v<k>/` (k = 1, 2, ...; layout in `gti.sid.lineage`). The work happens in
`<run>/refresh/.v<k>.partial/`; a rerun of the same command (same inputs and settings) reuses
it: finished steps are skipped and grounding/SFT resume from their last Ray Train checkpoint.

Ray: only through `gti.stages._ray.ensure_ray` and `gti.train.loop.fit` (this module is a
driver, like `gti.vocab_ground`). It reads with the ingest stage's public API: the readers of
`gti.data.sources` (`Source`, `local_stream`, `iterate`, `raise_file_error`,
`fill_interaction_raw`) and `gti.stages.ingest` (`ingest_items`, the output schemas such as
`INTER_Q_SCHEMA`); from other stage modules it reuses `gti.stages.pairs` (`RenderPairs`, `PAIRS_SCHEMA`), `gti.stages.ground`
(`write_val_set`, `VAL_TASKS`); the SFT hooks and `rebuild_trained` come from `gti.train.sft_task`.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from gti import config as C
from gti.train.driver import STORAGE_DIR
from gti.errors import DataError, GtiError
from gti.manifest import MANIFEST_NAME, Manifest, atomic_write_bytes, atomic_write_json, stable_hash

STEPS_FILE = "_steps.json"
FINGERPRINT_FILE = "_fingerprint"
RAY_DIR = STORAGE_DIR  # gti.train.driver.STORAGE_DIR
GROUND_RUN = "refresh_ground"
SFT_RUN = "refresh_sft"
NEEDS_NEW_TOKENS = "needs_new_tokens.json"


class RefreshError(GtiError):
    """The run cannot be refreshed as asked (missing stages, a full prefix group); one line."""


@dataclass
class RefreshResult:
    k: int
    dir: Path
    parent_hash: str
    new_hash: str
    facts: dict[str, Any]

    @property
    def model_dir(self) -> Path:
        return self.dir / "model"

    @property
    def map_path(self) -> Path:
        return self.dir / "sid" / "sid_map.parquet"


# --------------------------------------------------------------------------- helpers
def _log_default(msg: str) -> None:
    print(f"[refresh] {msg}", file=sys.stderr, flush=True)


def _manifest(run_dir: Path, stage: str) -> Manifest:
    if not (run_dir / stage / MANIFEST_NAME).is_file():
        raise RefreshError(f"{run_dir}: stage '{stage}' has not completed; refresh needs a trained run "
                           "(ingest, embed, sid, pairs and ground or sft)")
    return Manifest.read(run_dir / stage)


def _files_fingerprint(path: str | None, kind: str) -> str | None:
    if path is None:
        return None
    from gti.data import adapters
    from gti.manifest import file_fingerprint

    return stable_hash([f"{Path(f).name}:{file_fingerprint(f)}" for f in adapters.expand_paths(path, kind)])


def load_run_config(run_dir: Path, items: str, interactions: str | None,
                    overrides: Sequence[str] = ()) -> C.RunConfig:
    """The config the run's model was trained with (`<run>/sft/config.yaml`, else ground's, else
    `<run>/config.yaml`) + overrides, reading the new files."""
    path = next((p for p in (run_dir / "sft" / "config.yaml", run_dir / "ground" / "config.yaml")
                 if p.is_file()), run_dir / "config.yaml")
    raw = C.read_yaml(path) if path.is_file() else {}
    raw = C.apply_overrides(raw, list(overrides), str(path)) if overrides else raw
    data = raw.setdefault("data", {})
    data.setdefault("items", {})["path"] = str(items)
    if interactions is not None:
        data.setdefault("interactions", {})["path"] = str(interactions)
    data["max_items"] = None  # caps of the run's catalog read never cut the new items
    data["max_users"] = None
    raw["run_dir"] = str(run_dir)
    return C.validate(raw, f"{path} (refresh)")


class _Steps:
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


@dataclass
class _Parent:
    """What the refresh builds on: the newest version of the run (a refresh, else the run)."""

    k: int  # 0 = the run itself
    map_path: Path
    hash: str
    model_dir: Path
    interactions_path: Path
    pair_files: list[Path]


def _parent(run_dir: Path) -> _Parent:
    from gti.run_artifacts import RunDirError, find_model_dir
    from gti.sid import lineage

    sid = _manifest(run_dir, "sid")
    pairs = _manifest(run_dir, "pairs")
    ing = _manifest(run_dir, "ingest")
    pair_files = [pairs.output(run_dir / "pairs", "pairs")]
    inter = ing.output(run_dir / "ingest", "interactions")
    vs = lineage.versions(run_dir)
    for v in vs:
        if (v.dir / "pairs_new.parquet").is_file():
            pair_files.append(v.dir / "pairs_new.parquet")
        if (v.dir / "ingest" / "interactions.parquet").is_file():
            inter = v.dir / "ingest" / "interactions.parquet"
    if vs:
        v = vs[-1]
        return _Parent(v.k, v.map_path, v.version().hash, v.model_dir, inter, pair_files)
    try:
        _, model_dir = find_model_dir(run_dir)
    except RunDirError as err:
        raise RefreshError(str(err)) from None
    return _Parent(0, sid.output(run_dir / "sid", "sid_map"), sid.fact("sid_map_hash"), model_dir, inter,
                   pair_files)


# --------------------------------------------------------------------------- entry point
def refresh(run_dir: str | Path, items: str | Path, interactions: str | Path | None = None,
            overrides: Sequence[str] = (), *, log: Callable[[str], None] = _log_default,
            fault_injection: dict | None = None) -> RefreshResult:
    """Refresh the run in `run_dir` with the new items (see the module docstring).

    items / interactions: paths in any format `data.items.path` / `data.interactions.path` take
    (the run's column mapping and format apply; override them with `data.items.format=csv` etc.).
    overrides: key=value on the run's config (`refresh.*`, `ground.*`, `sft.*`, ...).
    fault_injection (tests): {"fail_at_step", "fail_rank", "fail_marker"} for the grounding loop.
    Returns a RefreshResult; user mistakes raise GtiError subclasses (one line).
    """
    from gti.sid import lineage
    from gti.sid import versions as V

    t_start = time.time()
    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RefreshError(f"run directory not found: {run_dir}")
    cfg = load_run_config(run_dir, str(items), None if interactions is None else str(interactions), overrides)
    rc = cfg.refresh
    if rc.sft_steps > 0 and interactions is None:
        raise C.ConfigError("refresh.sft_steps > 0 needs --interactions (the SFT pass trains on them)")
    parent = _parent(run_dir)
    sid_man = _manifest(run_dir, "sid")
    sf = sid_man.facts

    # The lineage always holds the run's base map, so any later map can be traced back to it.
    lin = lineage.lineage_dir(run_dir)
    base_hash = sf["sid_map_hash"]
    cb_hash = V.codebooks_hash(sid_man.output(run_dir / "sid", "codebooks"))
    if lin.get(base_hash) is None:
        import pyarrow.parquet as pq

        base_table = pq.read_table(str(sid_man.output(run_dir / "sid", "sid_map")))
        lin.add(V.make_version(base_table, cb_hash, sf["codebook_sizes"], sf["token_format"], None,
                               note="base: the run's sid stage"), base_table)

    k = parent.k + 1
    root = lineage.refresh_root(run_dir)
    work = root / f".v{k}.partial"
    dumped = cfg.model_dump(mode="json")
    fp = stable_hash({
        "parent": parent.hash, "items": _files_fingerprint(str(items), "items"),
        "interactions": _files_fingerprint(None if interactions is None else str(interactions), "interactions"),
        "seed": cfg.seed, **{s: dumped[s] for s in ("data", "embed", "pairs", "ground", "sft", "refresh")},
    })
    marker = work / FINGERPRINT_FILE
    if work.exists() and (not marker.is_file() or marker.read_text().strip() != fp):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(marker, fp.encode())
    log(f"v{k} of {run_dir} (parent map {parent.hash}, model {parent.model_dir})")
    steps = _Steps(work, log)
    job = _Job(run_dir, cfg, parent, work, k, sf, cb_hash, log, interactions is not None)

    f_ingest = steps.run("ingest", job.ingest)
    f_embed = steps.run("embed", job.embed)
    f_assign = steps.run("assign", job.assign)
    f_pairs = steps.run("pairs", job.pairs)
    f_ground = steps.run("ground", lambda: job.ground(fault_injection))
    f_sft = steps.run("sft", job.sft)
    f_export = steps.run("export", job.export)

    version = V.read_version(work / "sid" / "sid_map.parquet")
    facts = {
        "version": k,
        "parent_hash": parent.hash,
        "new_hash": version.hash,
        "parent_version": parent.k,
        "parent_model": str(parent.model_dir),
        "assigned": f_assign["assigned"],
        "already_present": f_assign["already_present"],
        "prefix_changed": f_assign["prefix_changed"],
        "full_groups": f_assign["needs_new_tokens"],
        "n_items": version.n_items,
        "ingest": f_ingest,
        "embed": f_embed,
        "pairs": f_pairs,
        "ground": f_ground,
        "sft": f_sft,
        "export": f_export,
        "steps": {"ground": f_ground.get("steps_done", 0), "sft": f_sft.get("steps_done", 0)},
        "wall_s": steps.walls(),
        "total_wall_s": round(time.time() - t_start, 3),
    }
    outputs = {"sid_map": "sid/sid_map.parquet", "sid_map_version": "sid/sid_map.version.json",
               "model": "model", "items": "ingest/items.parquet",
               "items_quarantine": "ingest/items_quarantine.parquet", "pairs_new": "pairs_new.parquet"}
    for name in ("interactions", "interactions_quarantine", "sequences"):
        if (work / "ingest" / f"{name}.parquet").is_file():
            outputs[name] = f"ingest/{name}.parquet"
    red = C.redact(dumped)
    Manifest(stage="refresh", fingerprint=fp,
             config={"seed": cfg.seed, **{s: red[s] for s in ("data", "embed", "pairs", "ground", "sft", "refresh")}},
             inputs={"parent": parent.hash, "items": str(items), "interactions": str(interactions)},
             facts=facts, outputs=outputs, duration_s=facts["total_wall_s"]).write(work)
    atomic_write_bytes(work / "config.yaml", C.dump(cfg).encode())
    import pyarrow.parquet as pq

    lin.add(version, pq.read_table(str(work / "sid" / "sid_map.parquet")))
    shutil.rmtree(work / RAY_DIR, ignore_errors=True)
    marker.unlink(missing_ok=True)
    final = root / f"v{k}"
    if final.exists():  # a finished folder without a manifest (never listed as a version)
        shutil.rmtree(final)
    work.rename(final)
    log(f"v{k}: {facts['assigned']} new items, map {parent.hash} -> {version.hash}; "
        f"ground {facts['steps']['ground']} steps, sft {facts['steps']['sft']} steps; "
        f"{facts['total_wall_s']:.1f}s -> {final}")
    return RefreshResult(k=k, dir=final, parent_hash=parent.hash, new_hash=version.hash, facts=facts)


# --------------------------------------------------------------------------- the steps
class _Job:
    def __init__(self, run_dir: Path, cfg: C.RunConfig, parent: _Parent, work: Path, k: int, sid_facts: dict,
                 cb_hash: str, log, interactions_given: bool) -> None:
        self.run_dir, self.cfg, self.parent, self.work, self.k = run_dir, cfg, parent, work, k
        self.sf, self.cb_hash, self.log = sid_facts, cb_hash, log
        self.interactions_given = interactions_given

    # ---- 1. ingest
    def ingest(self) -> dict:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from gti.data.idset import IdSet
        from gti.data.sources import Source, fill_interaction_raw, iterate, local_stream, raise_file_error
        from gti.stages import ingest as ING

        out = self.work / "ingest"
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        ctx = SimpleNamespace(cfg=self.cfg, log=lambda m: self.log(f"ingest: {m}"), work_dir=out)
        st, kept = ING.ingest_items(ctx, out, local_stream, Source(self.cfg.data, "items", ctx.log))
        facts: dict[str, Any] = {"items_rows_in": st.rows_in, "items_rows_ok": st.ok,
                                 "items_rows_quarantined": st.quarantined,
                                 "items_quarantine_reasons": dict(st.reasons)}
        self.log(f"ingest: {st.ok} new items ok, {st.quarantined} quarantined "
                 f"({', '.join(f'{r}: {n}' for r, n in st.reasons.most_common()) or 'none'})")
        if not self.interactions_given:
            return facts
        old_ids = IdSet()
        old_ids.add(pq.read_table(str(self.parent.map_path), columns=["item_id"]).column("item_id"))
        d = self.cfg.data
        src = Source(d, "interactions", ctx.log)
        has_ts = d.interactions.columns.ts is not None
        import polars as pl

        from gti.data import catalog as cat
        from gti.data.sequences import build_sequences

        old = pl.read_parquet(self.parent.interactions_path)
        ts0 = int(old["ts"].max()) + 1 if old.height else 0
        parts, rows_in, reasons = [], 0, {}
        w_q = pq.ParquetWriter(out / "interactions_quarantine.parquet", ING.INTER_Q_SCHEMA)
        try:
            for batch in iterate(local_stream, src.tasks, "interactions", d.interactions.columns,
                                 d.max_text_chars, None):
                raise_file_error(batch)
                n = batch.num_rows
                valid = np.asarray(pc.is_null(batch.column("reason")).to_numpy(zero_copy_only=False))
                ids = batch.column("item_id")
                known = old_ids.contains(ids) | kept.contains(ids)
                unknown = valid & ~known
                reason = batch.column("reason").to_pylist()
                detail = batch.column("detail").to_pylist()
                for i in np.nonzero(unknown)[0]:
                    reason[i], detail[i] = cat.UNKNOWN_ITEM, "item_id"
                batch = batch.set_column(batch.schema.get_field_index("reason"), "reason", pa.array(reason, pa.string()))
                batch = batch.set_column(batch.schema.get_field_index("detail"), "detail", pa.array(detail, pa.string()))
                ok_mask = pa.array(valid & known)
                bad = batch.filter(pa.array(~(valid & known)))
                if bad.num_rows:
                    bad = fill_interaction_raw(bad)
                    w_q.write_table(bad.select(cat.INTERACTIONS_QUARANTINE_COLUMNS).cast(ING.INTER_Q_SCHEMA))
                    for r in bad.column("reason").to_pylist():
                        reasons[r] = reasons.get(r, 0) + 1
                ok = batch.filter(ok_mask).select(["user_id", "item_id", "ts", "source_file", "source_row"])
                ok = ok.append_column("order", pa.array(range(old.height + rows_in, old.height + rows_in + ok.num_rows),
                                                        pa.int64()))
                if not has_ts:  # file order is the clock: after everything the run saw
                    ok = ok.set_column(2, "ts", pa.array(np.asarray(ok.column("order").to_numpy()) - old.height + ts0))
                parts.append(ok)
                rows_in += n
            new = pl.from_arrow(pa.concat_tables(parts)) if parts else None
            n_ok = 0 if new is None else new.height
            if n_ok == 0:
                raise DataError(f"data.interactions.path {d.interactions.path}: no valid new interactions "
                                f"({rows_in} rows read; {', '.join(f'{k}: {v}' for k, v in reasons.items()) or 'no rows'})")
            merged = pl.concat([
                old.with_columns(order=pl.int_range(0, old.height, dtype=pl.Int64),
                                 source_file=pl.lit(None, pl.Utf8), source_row=pl.lit(None, pl.Int64)),
                new.select("user_id", "item_id", pl.col("ts").cast(pl.Int64), "order", "source_file", "source_row"),
            ], how="diagonal_relaxed")
            res = build_sequences(merged, d.min_seq_len, None)
            if res.dropped.height:  # only new rows can drop: old users only grow
                dropped = res.dropped.with_columns(
                    pl.lit("user_id").alias("detail"),
                    pl.struct("user_id", "item_id", "ts").map_elements(
                        lambda s: json.dumps({k: None if v is None else str(v) for k, v in s.items()}),
                        return_dtype=pl.String).alias("raw"),
                ).select(cat.INTERACTIONS_QUARANTINE_COLUMNS)
                w_q.write_table(dropped.to_arrow().cast(ING.INTER_Q_SCHEMA))
                for r in res.dropped["reason"].to_list():
                    reasons[r] = reasons.get(r, 0) + 1
        finally:
            w_q.close()
        pq.write_table(res.interactions.to_arrow().cast(ING.INTER_OUT_SCHEMA), out / "interactions.parquet")
        pq.write_table(res.sequences.to_arrow().cast(ING.SEQ_SCHEMA), out / "sequences.parquet")
        touched = sorted(set(new["user_id"].to_list()) & set(res.sequences["user_id"].to_list()))
        pl.DataFrame({"user_id": touched}, schema={"user_id": pl.Utf8}).write_parquet(out / "touched_users.parquet")
        facts.update({"interactions_rows_in": rows_in, "interactions_rows_ok": n_ok - res.dropped.height,
                      "interactions_rows_quarantined": rows_in - n_ok + res.dropped.height,
                      "interactions_quarantine_reasons": reasons, "n_users": res.sequences.height,
                      "touched_users": len(touched)})
        self.log(f"ingest: {facts['interactions_rows_ok']} new interactions ok, "
                 f"{facts['interactions_rows_quarantined']} quarantined; {len(touched)} users touched")
        return facts

    # ---- 2. embed
    def embed(self) -> dict:
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        from gti.embed.encoders import build_encoder, item_text

        e = self.cfg.embed
        items = pq.read_table(str(self.work / "ingest" / "items.parquet")).to_pydict()
        enc = build_encoder(e, self.cfg.model, device="cuda" if e.num_gpus > 0 else "cpu", seed=self.cfg.seed)
        texts = [item_text(t or "", d or "", c or "", a or "", e.fields) for t, d, c, a in
                 zip(items["title"], items["description"], items["category"], items["attributes_text"])]
        vecs = np.concatenate([enc.encode(texts[i: i + e.batch_size]) for i in range(0, len(texts), e.batch_size)])
        vecs = np.ascontiguousarray(vecs, dtype=np.float32)
        bad = np.nonzero(~np.isfinite(vecs).all(1))[0]
        if bad.size:
            raise DataError(f"embed.encoder {e.encoder}: non-finite embedding for new item_id {items['item_id'][bad[0]]}")
        want = Manifest.read(self.run_dir / "embed").facts.get("dim")
        if want is not None and int(want) != vecs.shape[1]:
            raise RefreshError(f"embed: the encoder gives dim {vecs.shape[1]} but the run's embeddings have {want}; "
                               "refresh with the run's embed settings")
        (self.work / "embed").mkdir(exist_ok=True)
        arr = pa.FixedSizeListArray.from_arrays(pa.array(vecs.reshape(-1)), vecs.shape[1])
        pq.write_table(pa.table({"item_id": items["item_id"], "embedding": arr}),
                       str(self.work / "embed" / "embeddings.parquet"))
        return {"n_items": len(texts), "dim": int(vecs.shape[1]), "encoder": e.encoder}

    # ---- 3. assign
    def assign(self) -> dict:
        import pyarrow.parquet as pq
        import torch

        from gti.sid import versions as V
        from gti.sid.kmeans import sq_dists
        from gti.sid.quantizer import load_quantizer
        from gti.sid.embeddings import embedding_matrix

        t = pq.read_table(str(self.work / "embed" / "embeddings.parquet"))
        ids = t.column("item_id").to_pylist()
        x = torch.from_numpy(embedding_matrix(t.column("embedding"), "embeddings").copy())
        q = load_quantizer(self.run_dir / "sid")
        sf = self.sf
        with torch.inference_mode():
            pre = q.encode(x)
            last_cost = None
            if not sf.get("dedup_level_added", True) and int(sf["levels"]) == q.levels:
                last_cost = sq_dists(q.last_residual(x).float(), q.level_codebooks()[-1].float())
        parent_map = pq.read_table(str(self.parent.map_path))
        a = V.assign_new_items(parent_map, ids, pre, sf["codebook_sizes"], sf["token_format"], last_cost=last_cost)
        self.log(f"assign: {a.summary()}")
        if a.needs_new_tokens:
            path = self.work / NEEDS_NEW_TOKENS
            atomic_write_json(path, [{"item_id": n.item_id, "codes": list(n.codes), "reason": n.reason}
                                     for n in a.needs_new_tokens])
            first = a.needs_new_tokens[0]
            raise RefreshError(
                f"refresh: {len(a.needs_new_tokens)} new item(s) need a SID token the vocabulary lacks "
                f"(e.g. '{first.item_id}': {first.reason}); refresh.on_full_group={self.cfg.refresh.on_full_group} "
                f"(adding tokens is not supported yet); the list is in {path}")
        version = V.make_version(a.table, self.cb_hash, sf["codebook_sizes"], sf["token_format"], self.parent.hash,
                                 note=f"refresh v{self.k}: +{len(a.assigned)} items")
        (self.work / "sid").mkdir(exist_ok=True)
        V.write_map(self.work / "sid" / "sid_map.parquet", a.table, version)
        atomic_write_json(self.work / "sid" / "new_items.json",
                          {"assigned": a.assigned, "already_present": a.already_present,
                           "prefix_changed": a.prefix_changed})
        return {"assigned": len(a.assigned), "already_present": len(a.already_present),
                "prefix_changed": len(a.prefix_changed), "needs_new_tokens": 0,
                "parent_hash": self.parent.hash, "new_hash": version.hash}

    def _assigned(self) -> list[str]:
        return json.loads((self.work / "sid" / "new_items.json").read_text())["assigned"]

    def _tokenizer(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.parent.model_dir),
                                            trust_remote_code=self.cfg.model.trust_remote_code)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok

    # ---- 4. pairs
    def pairs(self) -> dict:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from gti.sid.codec import SidCodec
        from gti.stages.pairs import PAIRS_SCHEMA, RenderPairs

        cfg = self.cfg
        pf = Manifest.read(self.run_dir / "pairs").facts
        tok = self._tokenizer()
        codec = SidCodec.from_facts(self.sf)
        table = codec.code_to_token_id_table(tok).numpy()
        wrap = tuple(pf["sid_markers"]) if pf.get("sid_markers") else None
        assigned = set(self._assigned())
        items = pq.read_table(str(self.work / "ingest" / "items.parquet"))
        items = items.filter(pc.is_in(items.column("item_id"), pa.array(sorted(assigned), pa.string())))
        smap = pq.read_table(str(self.work / "sid" / "sid_map.parquet"))
        code_of = dict(zip(smap.column("item_id").to_pylist(), smap.column("codes").to_pylist()))
        items = items.append_column("codes", pa.array([code_of[i] for i in items.column("item_id").to_pylist()],
                                                      pa.list_(pa.int32())))
        render = RenderPairs(tok, table, cfg.pairs.model_dump(), cfg.seed, wrap, set())
        blocks = [render(items.slice(s, 256)) for s in range(0, items.num_rows, 256)]
        new = pa.concat_tables(blocks) if blocks else PAIRS_SCHEMA.empty_table()
        truncated = int(pc.sum(new.column("truncated")).as_py() or 0) if "truncated" in new.column_names else 0
        new = new.select(PAIRS_SCHEMA.names).cast(PAIRS_SCHEMA)
        pq.write_table(new, str(self.work / "pairs_new.parquet"))
        n_new_train = int(pc.sum(pc.equal(new.column("split"), "train")).as_py() or 0)
        pool = pa.concat_tables([pq.read_table(str(p)).select(PAIRS_SCHEMA.names).cast(PAIRS_SCHEMA)
                                 for p in self.parent.pair_files])
        pool = pool.filter(pc.equal(pool.column("split"), "train"))
        n_rep = min(pool.num_rows, int(round(cfg.refresh.replay_ratio * n_new_train)))
        rng = np.random.default_rng([cfg.seed, self.k, 0x2EF])
        rows = np.sort(rng.choice(pool.num_rows, size=n_rep, replace=False)) if n_rep else np.zeros(0, np.int64)
        replay = pool.take(pa.array(rows, pa.int64()))
        pq.write_table(pa.concat_tables([new, replay]), str(self.work / "pairs.parquet"))
        self.log(f"pairs: {new.num_rows} pairs of {len(assigned)} new items ({n_new_train} train), "
                 f"{n_rep} replayed old pairs (refresh.replay_ratio={cfg.refresh.replay_ratio:g})")
        return {"new_pairs": new.num_rows, "new_train_pairs": n_new_train, "replay_pairs": n_rep,
                "truncated_pairs": truncated}

    # ---- 5. ground
    def _start_rows(self, model, first: int, end: int) -> dict:
        from gti.lm import vocab

        out = {"e_new": model.get_input_embeddings().weight[first:end].detach().float().clone()}
        head = model.get_output_embeddings()
        if head is not None and not vocab.heads_tied(model):
            out["head_new"] = head.weight[first:end].detach().float().clone()
        return out

    def ground(self, fault_injection: dict | None) -> dict:
        import math

        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        import torch
        from safetensors.torch import save_file

        from gti.lm import models, vocab
        from gti.sid.codec import SidCodec
        from gti.stages._ray import ensure_ray
        from gti.stages.ground import VAL_TASKS, write_val_set
        from gti.train.deepspeed_config import micro_batch
        from gti.train import ground_task
        from gti.train.loop import fit, train_dataset_from_parquet

        cfg, rc = self.cfg, self.cfg.refresh
        out_dir = self.work / "ground_model"
        if rc.ground_steps == 0:
            self.log("ground: refresh.ground_steps=0: SIDs only, the parent's model is kept as it is")
            return {"steps_done": 0, "grounded": False}
        pf = Manifest.read(self.run_dir / "pairs").facts
        first, end = (int(x) for x in pf["new_token_ids"])
        codec = SidCodec.from_facts(self.sf)
        first_sid, end_sid = first, first + codec.num_tokens
        g = cfg.ground.model_copy(update={"steps": rc.ground_steps, **({"lr": rc.ground_lr} if rc.ground_lr else {})})
        gcfg = cfg.model_copy(update={"ground": g, "model": cfg.model.model_copy(update={"name": str(self.parent.model_dir)})})
        micro = micro_batch(g, g.num_workers)
        pairs_path = self.work / "pairs.parquet"
        n_train = int(pc.sum(pc.equal(pq.read_table(str(pairs_path), columns=["split"]).column("split"), "train")).as_py() or 0)
        if n_train < g.num_workers * micro:
            raise DataError(f"{pairs_path}: {n_train} train pairs cannot fill one micro-batch of {micro} on each of "
                            f"{g.num_workers} workers (ground.batch_size / ground.num_workers)")
        tok = self._tokenizer()
        model, _ = models.load_model_and_tokenizer(cfg.model, path=self.parent.model_dir)
        start = self._start_rows(model, first, end)
        save_file({k: v.contiguous() for k, v in start.items()}, str(self.work / "e_new_start.safetensors"))
        # Validation on the new items: their held-out text->SID pairs, else (few new items, none
        # held out) their training text->SID pairs, in-sample.
        new = pq.read_table(str(self.work / "pairs_new.parquet"))
        is_t2s = pc.is_in(new.column("task"), pa.array(list(VAL_TASKS)))
        held = pc.and_(is_t2s, pc.equal(new.column("split"), "val"))
        in_sample = not pc.any(held).as_py()
        if in_sample:
            new = new.set_column(new.schema.get_field_index("split"), "split",
                                 pc.if_else(is_t2s, pa.scalar("val"), new.column("split")))
        pq.write_table(new, str(self.work / "val_source.parquet"))
        shim = SimpleNamespace(cfg=gcfg, input=lambda stage, name: self.work / "val_source.parquet")
        n_val = write_val_set(shim, self.work, first_sid, end_sid, codec.levels)
        smap = pq.read_table(str(self.work / "sid" / "sid_map.parquet"), columns=["codes"])
        codes = torch.tensor(smap.column("codes").to_pylist(), dtype=torch.long)
        save_file({"sid_token_ids": codec.token_ids(codes, tok).contiguous()}, str(self.work / "catalog_sids.safetensors"))
        pad_id = int(tok.pad_token_id)
        loop_config = {
            "task": "ground", "hooks": ground_task.HOOKS, "run_config": gcfg.model_dump(mode="json"), "pad_id": pad_id,
            "ground": {"init_path": str(self.work / "e_new_start.safetensors"), "first_new_id": first,
                       "n_new": end - first},
            "val": None if n_val == 0 else {
                "path": str(self.work / "val_prompts.parquet"), "sids_path": str(self.work / "catalog_sids.safetensors"),
                "new_start": first, "new_end": end, "levels": codec.levels, "pad_id": pad_id},
            **(fault_injection or {}),
        }
        self.log(f"ground: {g.steps} steps x {g.batch_size} pairs on {g.num_workers} worker(s), lr {g.lr:g}, "
                 f"from {self.parent.model_dir}; {n_train} train pairs, {n_val} "
                 f"{'in-sample' if in_sample else 'held-out'} val prompts")
        ensure_ray(cfg)
        ds = train_dataset_from_parquet(pairs_path, seed=cfg.seed)
        res = fit(loop_config, ds, g, storage_path=self.work / RAY_DIR, name=GROUND_RUN,
                  log=lambda m: self.log(f"ground: {m}"), progress_every=max(g.log_every, math.ceil(g.steps / 20)))
        vocab.attach_new_rows(model, first, end - first, start["e_new"], start.get("head_new"))
        vocab.load_new_rows_state_dict(model, res.state_dict)
        vocab.export_model(model, tok, out_dir, dict(vocab.read_meta(self.parent.model_dir)))
        loss = res.history.get("loss", [])
        return {
            "grounded": True, "steps_done": res.steps_done, "lr": g.lr,
            "first_loss": loss[0][1] if loss else None, "final_loss": loss[-1][1] if loss else None,
            "val_exact_match": [{"step": int(s), "value": float(v)}
                                for s, v in res.history.get("val", {}).get("val_exact_match", [])],
            "val_in_sample": in_sample, "val_prompts": n_val, "train_pairs": n_train,
        }

    # ---- 6. sft
    def sft(self) -> dict:
        import numpy as np
        import polars as pl

        from gti.lm import vocab
        from gti.sid.codec import SidCodec
        from gti.stages._ray import ensure_ray
        from gti.lm import templates
        from gti.train import sft_data
        from gti.train.sft_task import HOOKS as SFT_HOOKS
        from gti.train.sft_task import rebuild_trained
        from gti.train.loop import fit

        cfg, rc = self.cfg, self.cfg.refresh
        if rc.sft_steps == 0:
            return {"steps_done": 0}
        start = self.work / "ground_model"
        if not (start / "config.json").is_file():
            start = self.parent.model_dir
        tok = self._tokenizer()
        smap = pl.read_parquet(self.work / "sid" / "sid_map.parquet")
        sid_ids = templates.sid_id_table(smap, SidCodec.from_facts(self.sf), tok)
        seqs = pl.read_parquet(self.work / "ingest" / "sequences.parquet")
        touched = pl.read_parquet(self.work / "ingest" / "touched_users.parquet")["user_id"]
        seqs = seqs.filter(pl.col("user_id").is_in(touched.implode()))
        windows = sft_data.training_windows(seqs, cfg.data.max_history, seed=cfg.seed)
        if windows.height == 0:
            raise DataError("refresh.sft_steps > 0 but no touched user has 2 or more training items "
                            "in the merged sequences: nothing to train on")
        renderer = templates.make_renderer(tok, sid_ids, cfg.pairs.system_prompt, cfg.sft.max_len,
                                          prompt_style=cfg.sft.prompt_style)
        rows = renderer.render_windows(windows.select("history", "target", "template").to_dict(as_series=False))
        frame = sft_data.rows_frame(rows).select(sft_data.ROW_COLUMNS)
        order = np.random.default_rng([cfg.seed, self.k, 0x5F7]).permutation(frame.height)
        train_path = self.work / "sft_train.parquet"
        frame[order].write_parquet(train_path)
        s = cfg.sft.model_copy(update={"steps": rc.sft_steps, **({"lr": rc.sft_lr} if rc.sft_lr else {})})
        scfg = cfg.model_copy(update={"sft": s})
        pad_id = int(tok.pad_token_id)
        loop_config = {"task": "sft", "run_config": scfg.model_dump(mode="json"), "pad_id": pad_id,
                       "hooks": SFT_HOOKS, "sft": {"model_dir": str(start)}, "val": None}
        self.log(f"sft: {s.steps} steps x batch {s.batch_size} on {frame.height} windows of "
                 f"{seqs.height} touched users, from {start}")
        ensure_ray(cfg)
        import ray

        ds = ray.data.read_parquet(str(train_path), columns=["input_ids", "labels"]).materialize()
        res = fit(loop_config, ds, s, storage_path=(self.work / RAY_DIR).resolve(), name=SFT_RUN,
                  log=lambda m: self.log(f"sft: {m}"), progress_every=max(1, s.log_every))
        model = rebuild_trained(start, scfg, res.state_dict)
        vocab.export_model(model, tok, self.work / "sft_model", dict(vocab.read_meta(start)))
        loss = res.history.get("loss", [])
        return {"steps_done": res.steps_done, "lr": s.lr, "windows": frame.height, "users": seqs.height,
                "first_loss": loss[0][1] if loss else None, "final_loss": loss[-1][1] if loss else None}

    # ---- 7. export
    def export(self) -> dict:
        from gti.lm.vocab import META_NAME
        from gti.sid import versions as V

        final = self.work / "model"
        cands = [(c, st) for c, st in ((self.work / "sft_model", "sft"), (self.work / "ground_model", "ground"))
                 if (c / "config.json").is_file()]
        if cands:
            if final.exists():
                shutil.rmtree(final)
            source = cands[0][1]
            (cands[0][0] / ".refresh_source").write_text(source)  # before the move: a rerun knows it
            cands[0][0].rename(final)
        elif (final / "config.json").is_file() and (final / ".refresh_source").is_file():
            source = (final / ".refresh_source").read_text().strip()  # an interrupted export moved it already
        else:
            if final.exists():
                shutil.rmtree(final)
            tmp = self.work / ".model.copy"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(self.parent.model_dir, tmp)
            source = "parent"
            (tmp / ".refresh_source").write_text(source)
            tmp.rename(final)
        version = V.read_version(self.work / "sid" / "sid_map.parquet")
        meta_path = final / META_NAME
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        meta.update({"stage": "refresh", "refresh_version": self.k, "sid_map_hash": version.hash,
                     "sid_map_parent": self.parent.hash, "sid_map_version": version.to_dict(),
                     "refreshed_from": str(self.parent.model_dir), "refresh_model_source": source})
        atomic_write_bytes(meta_path, json.dumps(meta, indent=2, sort_keys=True, default=str).encode())
        for f in ("e_new_start.safetensors", "val_source.parquet"):
            (self.work / f).unlink(missing_ok=True)
        return {"model_source": source}


# --------------------------------------------------------------------------- CLI
def cli_main(args) -> int:
    """`gti refresh --run-dir R --items NEW [--interactions NEW] [key=value ...]`."""
    res = refresh(args.run_dir, args.items, args.interactions, getattr(args, "overrides", None) or [])
    f = res.facts
    print(f"refresh v{res.k}: {f['assigned']} new items assigned ({f['already_present']} already present), "
          f"SID map {res.parent_hash} -> {res.new_hash}; ground {f['steps']['ground']} steps, "
          f"sft {f['steps']['sft']} steps; {f['total_wall_s']:.0f}s; model: {res.model_dir}")
    return 0
