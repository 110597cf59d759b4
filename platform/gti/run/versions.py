"""Which version of a run is current, which model folder and which SID map go together, and
whether a SID map is acceptable for a model: the one answer every reader of a run asks for.

What it is for: the layout `gti refresh` writes (`<run>/refresh/lineage/`: every map version;
`<run>/refresh/v<k>/`: a version's manifest, map and record, new items and model), read back:
`refresh_versions` / `next_version` (never numbered over), `base_record` / `current_versions`,
`resolve(run_dir, version)` (what `gti recommend`, `serve`, `infer` load and `gti refresh`
builds on), and `check_model_map` (the model's own map or one descending from it, else one line
naming both hashes).

What it does not know: models beyond their `gti_meta.json`, tokenizers beyond their vocabulary,
loading weights, training, Ray. It reads manifests and version records.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from gti.common.errors import GtiError
from gti.run.manifest import MANIFEST_NAME, Manifest
from gti.sid.versions import (
    LineageDir, MissingSidTokensError, SidMapVersion, UnrelatedSidMapError, check_map_for_model, read_version,
    version_path,
)

REFRESH_DIR = "refresh"
LINEAGE_DIR = "lineage"
MAP_REL = "sid/sid_map.parquet"  # inside a version folder
MODEL_REL = "model"
META_NAME = "gti_meta.json"  # an exported model's record (gti.lm.new_rows writes it)
MODEL_STAGES = ("rl", "sft", "ground")  # where the run's own model comes from, newest first
BASE_FACT = "base"  # in a refresh version's manifest facts: the base it was made on
_VDIR = re.compile(r"^v(\d+)$")

Note = Callable[[str], None]


class RunDirError(GtiError):
    """The run directory lacks what is asked of it (a model, a SID map, a version)."""


_noted: set[str] = set()


def note_once(line: str) -> None:
    """One stderr line per process and message (a server re-resolving versions says it once)."""
    if line not in _noted:
        _noted.add(line)
        print(f"gti: note: {line}", file=sys.stderr, flush=True)


def _silent(line: str) -> None:
    return None


# --------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class RefreshVersion:
    """One finished refresh of a run: `<run_dir>/refresh/v<k>/`."""

    k: int
    dir: Path

    @property
    def map_path(self) -> Path:
        return self.dir / MAP_REL

    @property
    def model_dir(self) -> Path:
        return self.dir / MODEL_REL

    @property
    def items_path(self) -> Path:
        return self.dir / "ingest" / "items.parquet"

    @property
    def sequences_path(self) -> Path:
        return self.dir / "ingest" / "sequences.parquet"

    def map_version(self) -> SidMapVersion:
        """The version record of its SID map (DataError when it has none)."""
        v = read_version(self.map_path)
        if v is None:
            from gti.common.errors import DataError

            raise DataError(f"{self.map_path}: refreshed SID map without its version record")
        return v


def refresh_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / REFRESH_DIR


def lineage_dir(run_dir: str | Path) -> LineageDir:
    return LineageDir(refresh_root(run_dir) / LINEAGE_DIR)


def refresh_versions(run_dir: str | Path) -> list[RefreshVersion]:
    """Every finished refresh of the run (those with a manifest), whatever base it was made on,
    oldest first (`current_versions`: only those of the current base)."""
    root = refresh_root(run_dir)
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _VDIR.match(p.name)
            if m and p.is_dir() and (p / MANIFEST_NAME).is_file():
                out.append(RefreshVersion(int(m.group(1)), p))
    return sorted(out, key=lambda v: v.k)


def next_version(run_dir: str | Path) -> int:
    """k of the next refresh: after the highest published `v<k>` (those made on an older base
    included), so a version is never numbered over, nor replaced."""
    return max((v.k for v in refresh_versions(run_dir)), default=0) + 1


def find_lineage(map_path: str | Path) -> LineageDir | None:
    """The lineage folder of the run `map_path` lies in, or None (a run never refreshed)."""
    p = Path(map_path).resolve()
    for folder in p.parents:
        cand = folder / REFRESH_DIR / LINEAGE_DIR
        if cand.is_dir():
            return LineageDir(cand)
    return None


def find_model_dir(run_dir: Path) -> tuple[str, Path]:
    """(stage, folder) of the run's own newest exported model: rl (when it trained), else sft,
    else ground."""
    for stage in MODEL_STAGES:
        stage_dir = run_dir / stage
        if (stage_dir / MANIFEST_NAME).is_file():
            man = Manifest.read(stage_dir)
            if "model" in man.outputs:
                path = man.output(stage_dir, "model")
                if (path / "config.json").is_file():
                    return stage, path
        elif (stage_dir / "model" / "config.json").is_file():
            return stage, stage_dir / "model"
    raise RunDirError(
        f"{run_dir}: no exported model (looked for {' and '.join(f'{s}/model' for s in MODEL_STAGES)}); "
        "run the pipeline through 'ground' or 'sft' first"
    )


# --------------------------------------------------------------------------- bases
def base_record(run_dir: Path) -> dict[str, Any]:
    """What a refresh of `run_dir` builds on now: the model stage a refresh starts from (sft,
    else ground), that stage's manifest fingerprint and creation time (a `gti run --force` with
    an unchanged config keeps the fingerprint but retrains), and the sid stage's map hash."""
    try:
        stage, _ = find_model_dir(run_dir)
    except RunDirError:
        stage = None
    man = Manifest.read(run_dir / stage) if stage and (run_dir / stage / MANIFEST_NAME).is_file() else None
    sid = run_dir / "sid"
    map_hash = Manifest.read(sid).facts.get("sid_map_hash") if (sid / MANIFEST_NAME).is_file() else None
    return {"model_stage": stage, "model_fingerprint": man.fingerprint if man else None,
            "model_created": man.created if man else None, "sid_map_hash": map_hash}


def _describe(b: dict) -> str:
    import datetime as dt

    when = b.get("model_created")
    when = dt.datetime.fromtimestamp(when).isoformat(timespec="seconds") if isinstance(when, (int, float)) else "?"
    return f"{b.get('model_stage')} model {b.get('model_fingerprint')} of {when}, SID map {b.get('sid_map_hash')}"


def stale_reason(v: RefreshVersion, base: dict[str, Any]) -> str | None:
    """Why version `v` does not belong to the run's current `base`, or None when it does. A
    version written before gti recorded bases has nothing to compare and is kept."""
    try:
        rec = (json.loads((v.dir / MANIFEST_NAME).read_text()).get("facts") or {}).get(BASE_FACT)
    except (OSError, ValueError, AttributeError):
        rec = None
    if not isinstance(rec, dict) or all(rec.get(k) == base[k] for k in base):
        return None
    return (f"{v.dir} is skipped: it was refreshed from another base of this run ({_describe(rec)}; "
            f"the run now has {_describe(base)})")


def current_versions(run_dir: Path, note: Note = note_once, base: dict | None = None) -> list[RefreshVersion]:
    """The finished refresh versions made on the run's current base (`base`, else
    `base_record`), oldest first; each one made on another base is skipped with one `note` line."""
    vs = refresh_versions(run_dir)
    if not vs:
        return []
    base = base_record(run_dir) if base is None else base
    out = []
    for v in vs:
        why = stale_reason(v, base)
        if why is None:
            out.append(v)
        else:
            note(why)
    return out


def _choose(run_dir: Path, version: int | None, note: Note,
            base: dict | None = None) -> tuple[RefreshVersion | None, list[RefreshVersion]]:
    """(the refresh version `version` names, or None for the run's own stages; the current
    versions up to it, oldest first). See `chosen_version`."""
    if version == 0:
        return None, []
    vs = current_versions(run_dir, note=_silent if version is not None else note, base=base)
    if version is None:
        return (vs[-1], vs) if vs else (None, [])
    for i, v in enumerate(vs):
        if v.k == version:
            return v, vs[:i + 1]
    for v in refresh_versions(run_dir):
        if v.k == version:
            why = stale_reason(v, base_record(run_dir) if base is None else base)
            raise RunDirError(str(why).replace(" is skipped:", " cannot be used:"))
    raise RunDirError(f"{run_dir}: no finished refresh version {version} "
                      f"(have: {', '.join(f'v{v.k}' for v in vs) or 'none'})")


def chosen_version(run_dir: Path, version: int | None, note: Note = note_once) -> RefreshVersion | None:
    """The refresh version a reader uses: None = the newest made on the run's current base if
    any (else the run's own stages), 0 = the run's own stages, k = `<run_dir>/refresh/v<k>/`
    (refused with one line when missing or made on another base)."""
    return _choose(Path(run_dir), version, note)[0]


# --------------------------------------------------------------------------- the answer
@dataclass(frozen=True)
class ResolvedVersion:
    """Version `k` of a run: the model folder and the SID map that go together (`resolve`)."""

    run_dir: Path
    k: int  # 0 = the run's own stages
    stage: str | None  # the model's source: "sft", "ground", "refresh/v<k>"; None: not looked up
    model_dir: Path | None
    map_path: Path
    map_hash: str
    sid: Manifest  # the run's sid stage (its facts spell the map: levels, sizes, token format)
    base: dict[str, Any]  # the run's current base (`base_record`)
    refreshes: tuple[RefreshVersion, ...]  # the current base's refreshes up to k, oldest first
    record: SidMapVersion | None = None  # the refreshed map's version record (None for k = 0)

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        """The map's: its version record's (a refresh may have grown the last level), else the
        sid stage's."""
        if self.record is not None:
            return tuple(self.record.codebook_sizes)
        return tuple(int(k) for k in self.sid.fact("codebook_sizes"))


def resolve(run_dir: str | Path, version: int | None = None, *, note: Note = note_once,
            find_model: bool = True) -> ResolvedVersion:
    """Which model and which SID map version `version` of `run_dir` is (see `chosen_version`
    for `version`); RunDirError (one line) for a missing run folder, sid stage, model or
    version. `find_model=False`: the run's own model is not looked up (a caller pairing
    another model with the map)."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    sid_dir = run_dir / "sid"
    if not (sid_dir / MANIFEST_NAME).is_file():
        raise RunDirError(f"{run_dir}: no finished sid stage ({sid_dir / MANIFEST_NAME} missing)")
    sid = Manifest.read(sid_dir)
    base = base_record(run_dir)
    chosen, line = _choose(run_dir, version, note, base)
    if chosen is not None:
        record = chosen.map_version()
        return ResolvedVersion(run_dir, chosen.k, f"{REFRESH_DIR}/v{chosen.k}", chosen.model_dir, chosen.map_path,
                               record.hash, sid, base, tuple(line), record)
    stage, model_dir = find_model_dir(run_dir) if find_model else (None, None)
    return ResolvedVersion(run_dir, 0, stage, model_dir, sid.output(sid_dir, "sid_map"),
                           str(sid.facts["sid_map_hash"]), sid, base, ())


# --------------------------------------------------------------------------- model <-> map
def model_meta(model_dir: str | Path) -> dict:
    """The model folder's `gti_meta.json` ({} when absent)."""
    p = Path(model_dir) / META_NAME
    return json.loads(p.read_text()) if p.is_file() else {}


def check_model_map(model_dir: str | Path, map_hash: str | None, *, map_path: str | Path | None = None,
                    lineage: LineageDir | None = None) -> int:
    """Accept the SID map (`map_hash`, the file `map_path`) for the model in `model_dir`.

    0 when the model was trained with this very map; k > 0 when the map descends from the
    model's map through k versions (checked on the tables: old items keep their SIDs, same
    codebook identity). Raises UnrelatedSidMapError naming both hashes otherwise. Reads the map
    table only when the hashes differ and a version record exists.
    """
    meta = model_meta(model_dir)
    got = meta.get("sid_map_hash")
    version = read_version(map_path) if map_path is not None and Path(map_path).is_file() else None
    if version is not None:
        if map_hash is not None and version.hash != map_hash:
            raise UnrelatedSidMapError(
                f"{version_path(map_path)} records hash {version.hash} but the map is given as {map_hash}")
        map_hash = version.hash
    if got and got == map_hash:
        return 0
    if lineage is None and map_path is not None:
        lineage = find_lineage(map_path)
    if version is None and lineage is not None and map_hash is not None:
        version = lineage.get(map_hash)
    if version is None or not got:
        raise UnrelatedSidMapError(
            f"{model_dir}/{META_NAME} has sid_map_hash {got or '<none recorded>'} but the SID map's "
            f"sid_map_hash is {map_hash}: stale SID map, rerun the stages after 'sid'")
    import pyarrow.parquet as pq

    table = pq.read_table(str(map_path)) if map_path is not None and Path(map_path).is_file() else None
    if table is None and lineage is not None:
        table = lineage.table(version.hash)
    ident = None
    rec = meta.get("sid_map_version")
    if isinstance(rec, dict) and rec.get("hash") == got:
        ident = SidMapVersion.from_dict(rec, f"{model_dir}/{META_NAME}").codebook_identity
    return check_map_for_model(got, version, lineage, model_dir=model_dir, child_table=table,
                               ancestor_identity=ident)


def check_exact_map(model_dir: str | Path, sid_map_hash: str) -> None:
    """UnrelatedSidMapError unless `model_dir/gti_meta.json` records exactly `sid_map_hash`
    (the sft stage trains on top of a model only with the very map it was made with)."""
    got = model_meta(model_dir).get("sid_map_hash")
    if got != sid_map_hash:
        raise UnrelatedSidMapError(
            f"{model_dir}/{META_NAME} has sid_map_hash {got or '<none recorded>'} but the sid stage's "
            f"sid_map_hash is {sid_map_hash}: stale SID map, rerun the stages after 'sid'"
        )


def check_tokens(tokenizer, codec, model_dir: Path, sid_map_path: Path) -> None:
    """MissingSidTokensError (one line naming them) unless the tokenizer has every SID token of
    `codec` (a model made before a refresh added codes lacks the added ones)."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in codec.tokens() if t not in vocab]
    if missing:
        shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise MissingSidTokensError(
            f"{model_dir}: its tokenizer lacks {len(missing)} SID token(s) of the SID map {sid_map_path} "
            f"(codebook sizes {codec.codebook_sizes}): {shown}; use the model of the refresh that added them")

