"""Records of finished arm runs: what lets a comparison resume on another machine.

What it is for: as each arm run of `gti compare` finishes, its report record (metrics with
per-user values, diagnostics, SFT curves, timing, the config it ran with) is kept as a file
(`record_path`) beside the content hashes of the shared tables it inherited
(`shared_identity`). `read_record` says whether a stored record stands for a planned run;
`load_record` builds a record from a finished run folder; `run_facts` are the small facts the
cross-arm report shows per run.

What it does not know: how runs are planned or scheduled (that is `gti.experiments.compare`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

from gti import config as C
from gti.common.errors import GtiError
from gti.experiments.shared_stages import ArmRun, CompareError, map_tag, slug
from gti.run.manifest import Manifest, ManifestError, file_fingerprint
from gti.common.files import atomic_write_json


RECORD_FORMAT = 1
# What the arm runs inherit from the shared stages, as (stage, output): their content decides
# whether a record made elsewhere stands for a run here.
SHARED_TABLES = (("ingest", "items"), ("ingest", "sequences"), ("sid", "sid_map"), ("pairs", "pairs"))
# Shared outputs compared byte for byte (tensors, where a content hash of rows does not apply).
SHARED_FILES = (("sid", "codebooks"),)
# Config keys left out when a record's config is compared with a run's: where and how a run is
# scheduled (not what it computes), and the sections only the shared stages read (`embed`,
# `sid`: their whole effect on an arm run is the SID map and codebooks, which are hashed).
NON_SEMANTIC_KEYS = ("run_dir", "ray_address", "ray_num_cpus", "compare", "embed", "sid")
# The rl stage's facts a run that trained RL (`gti+rl`) carries in its run facts, under `rl`.
RL_FACTS = ("enabled", "steps_done", "best", "stopped_at", "step_stats")


def records_dir(cfg: C.RunConfig, out: Path) -> Path:
    return Path(cfg.compare.records_dir).expanduser().resolve() if cfg.compare.records_dir else out / "records"


def record_path(rdir: Path, arm: str, seed: int, sid_seed: int | None = None) -> Path:
    """`<rdir>/<arm>/seed<s>.json`; on one of several SID maps `<rdir>/sid<m>/<arm>/seed<s>.json`,
    so the runs of one arm x seed on different maps never share a record."""
    base = rdir if sid_seed is None else rdir / map_tag(sid_seed)
    return base / slug(arm) / f"seed{seed}.json"


def table_hash(path: Path, columns: list[str] | None = None) -> str:
    """Order-free content hash of a parquet table (or of `columns` of it): schema + sorted row
    hashes (a Ray Data write may order rows differently from run to run; the content is what
    matters)."""
    import polars as pl

    df = pl.read_parquet(path, columns=columns)
    h = hashlib.sha256(str(df.schema).encode())
    h.update(df.hash_rows(seed=0).sort().to_numpy().tobytes())
    return h.hexdigest()[:16]


def shared_identity(shared_dir: Path) -> dict[str, str]:
    """{"stage/output": content hash} of the shared tables every arm run inherits (outputs a
    stage does not declare are left out; a file polars cannot read is hashed byte for byte,
    which is only stricter)."""
    import polars as pl

    out = {}
    for stage, name in SHARED_TABLES:
        d = shared_dir / stage
        m = Manifest.read(d)
        if name not in m.outputs:
            continue
        path = m.output(d, name)
        try:
            out[f"{stage}/{name}"] = table_hash(path)
        except (pl.exceptions.PolarsError, OSError):
            out[f"{stage}/{name}"] = "bytes:" + file_fingerprint(path)
    for stage, name in SHARED_FILES:
        d = shared_dir / stage
        m = Manifest.read(d)
        if name in m.outputs:
            out[f"{stage}/{name}"] = "bytes:" + file_fingerprint(m.output(d, name))
    return out


def _semantic(cfg_json: dict[str, Any]) -> dict[str, Any]:
    """The keys that shape an arm run's result: without the placement and shared-stage sections,
    and without `rl` when RL does not train (its other keys then change nothing)."""
    rl = cfg_json.get("rl") or {}
    idle_rl = not (rl.get("enabled") and rl.get("steps", 1) > 0)
    return {k: v for k, v in cfg_json.items() if k not in NON_SEMANTIC_KEYS and not (k == "rl" and idle_rl)}


def config_diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys where two config dumps differ (a key missing on one side differs)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in a or k not in b:
                out.append(key)
            else:
                out.extend(config_diff(a[k], b[k], key))
        return out
    return [] if a == b else [prefix or "<root>"]


def write_record(r: ArmRun, rdir: Path, identity: dict[str, str]) -> Path:
    """Keep the finished run `r` as a record file (`record_path`), with the hashes of its shared
    tables (`shared_identity`). A record already there is never rewritten: one that stands for
    this run is left as it is (a `--report-only` pass does not touch committed records), one for
    another run (other config or shared data, e.g. a committed one while a run with overrides
    finishes) raises CompareError naming both."""
    path = record_path(rdir, r.arm, r.seed, r.sid_seed)
    if path.is_file():
        stored, _, why = read_record(r, rdir, identity)
        if why:
            raise CompareError(f"kept the existing record, which is for another run: {why}")
        if stored is not None:  # it already stands for this run: left as written (no churn)
            return path
    rec = load_record(r)
    atomic_write_json(path, {
        "format": RECORD_FORMAT, "arm": r.arm, "seed": r.seed,
        **({} if r.sid_seed is None else {"sid_seed": r.sid_seed}), "shared": identity,
        "facts": run_facts(r), "record": dataclasses.asdict(rec),
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    })
    return path


def read_record(r: ArmRun, rdir: Path, identity: dict[str, str]):
    """(RunRecord, run facts, "") when a stored record stands for run `r`; (None, None, why
    not) otherwise ("" when there is no record at all). It stands for `r` with the same record
    format, the same shared hashes, and the same config once both are validated with today's
    code and the placement and shared-stage sections (`NON_SEMANTIC_KEYS`) are left out."""
    from gti.diagnostics.runs import RunRecord

    path = record_path(rdir, r.arm, r.seed, r.sid_seed)
    if not path.is_file():
        return None, None, ""
    try:
        doc = json.loads(path.read_text())
        rec = RunRecord(**doc["record"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, None, f"{path}: unreadable record ({type(err).__name__}: {err})"
    if doc.get("format") != RECORD_FORMAT:
        return None, None, f"{path}: record format {doc.get('format')!r}, expected {RECORD_FORMAT}"
    stored_shared = doc.get("shared") or {}
    differ = [k for k in sorted(set(identity) | set(stored_shared)) if identity.get(k) != stored_shared.get(k)]
    if differ:
        return None, None, f"{path}: made from other shared data ({', '.join(differ)} differ)"
    try:
        stored = C.validate(rec.config, f"record {path}").model_dump(mode="json")
    except GtiError as err:
        return None, None, f"{path}: its config does not validate today ({str(err).splitlines()[0]})"
    diff = config_diff(_semantic(stored), _semantic(r.cfg.model_dump(mode="json")))
    if diff:
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        return None, None, f"{path}: config differs at {', '.join(diff[:6])}{more}"
    return rec, doc.get("facts") or {}, ""


def _manifest_or_none(stage_dir: Path) -> Manifest | None:
    try:
        return Manifest.read(stage_dir)
    except ManifestError:
        return None


def _curves(sft: Manifest | None) -> dict[str, list[list[float]]]:
    """SFT validation curves {metric: [[step, value], ...]} from the sft manifest: facts
    `val_history` (every val metric), else the older single `val_recall@10` list."""
    if sft is None:
        return {}
    hist = sft.facts.get("val_history")
    if not isinstance(hist, dict):
        old = sft.facts.get("val_recall@10")
        hist = {"val_recall@10": old} if isinstance(old, list) else {}
    out = {}
    for metric, pts in hist.items():
        got = [[p["step"], p["value"]] for p in pts or [] if isinstance(p, dict) and "step" in p and "value" in p]
        if got:
            out[metric] = got
    return out


def _rl_trained(run_dir: Path) -> Manifest | None:
    """The rl stage's manifest when RL trained in the run (None: rl disabled, or a run older
    than the stage)."""
    m = _manifest_or_none(run_dir / "rl")
    return m if m is not None and m.facts.get("enabled") else None


def _timing(r: ArmRun, ground: Manifest | None, sft: Manifest | None, rl: Manifest | None = None) -> dict[str, Any]:
    """Wall seconds of the arm's ground and SFT stages, and RL's when it trained (manifest
    duration_s; 0 = not recorded) and the training loops' compute seconds (facts
    timing.compute_s) when present."""
    out: dict[str, Any] = {"grounding": bool(r.cfg.ground.enabled)}
    for name, m in (("ground", ground), ("sft", sft), ("rl", rl)):
        if m is None:
            continue
        if m.duration_s:
            out[f"{name}_s"] = float(m.duration_s)
        timing = m.facts.get("timing")
        compute = timing.get("compute_s") if isinstance(timing, dict) else None
        if compute is not None:
            out[f"{name}_compute_s"] = float(compute)
    return out if any(k.endswith("_s") for k in out) else {}


def _ran_with(r: ArmRun) -> dict[str, Any]:
    """The config the run's last stage ran with (run_dir/config.yaml, validated today, so keys
    added since count at their defaults); the planned config where that file is missing or no
    longer validates."""
    path = r.run_dir / "config.yaml"
    if path.is_file():
        try:
            return C.load(path, []).model_dump(mode="json")
        except GtiError:
            pass
    return r.cfg.model_dump(mode="json")


def load_record(r: ArmRun):
    """A RunRecord of a finished run (metrics, per-phase diagnostics, config, versions, SFT
    validation curves, ground/SFT (and RL) wall time)."""
    from gti.diagnostics.runs import RunRecord

    rep = Manifest.read(r.run_dir / "report")
    doc = json.loads(rep.output(r.run_dir / "report", "report_json").read_text())
    ev = Manifest.read(r.run_dir / "evaluate")
    metrics = json.loads(ev.output(r.run_dir / "evaluate", "metrics").read_text())
    ground, sft = _manifest_or_none(r.run_dir / "ground"), _manifest_or_none(r.run_dir / "sft")
    return RunRecord(
        arm=r.arm, seed=r.seed, metrics=metrics, diagnostics=doc["runs"][0]["diagnostics"],
        config=_ran_with(r), versions=rep.versions, run_dir=str(r.run_dir),
        curves=_curves(sft), timing=_timing(r, ground, sft, _rl_trained(r.run_dir)),
    )


def run_facts(r: ArmRun) -> dict[str, Any]:
    """init, steps, multitask, stage seconds and SFT examples of a run; when RL trained, also
    `rl_s` and the rl stage's facts (`RL_FACTS`) under `rl` (a run without RL has neither)."""
    facts: dict[str, Any] = {
        "init": r.cfg.init.method,
        "ground_steps": r.cfg.ground.steps if r.cfg.ground.enabled else 0,
        "sft_steps": r.cfg.sft.steps,
        "multitask": r.cfg.sft.multitask,
    }
    for stage in ("ground", "sft"):
        m = _manifest_or_none(r.run_dir / stage)
        if m is not None and m.duration_s:
            facts[f"{stage}_s"] = round(float(m.duration_s), 1)
        if stage == "sft":
            # SFT examples the run saw: steps it did (its manifest) x the global batch
            done = m.facts.get("steps_done") if m is not None else None
            steps = int(done) if isinstance(done, (int, float)) else r.cfg.sft.steps
            facts["sft_examples"] = steps * r.cfg.sft.batch_size
    rl = _rl_trained(r.run_dir)
    if rl is not None:
        if rl.duration_s:
            facts["rl_s"] = round(float(rl.duration_s), 1)
        facts["rl"] = {k: rl.facts.get(k) for k in RL_FACTS}
    return facts
