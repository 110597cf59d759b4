"""What one `gti refresh` attempt works with: the run, its config, the parent version, the work folder.

What it is for: the steps of a refresh (`gti.refresh.ingest`, `.new_items`, `.tokens`,
`.train`, `.command`) share one `Job`: the run folder, the config the run's model was trained
with plus the overrides (`load_run_config`), the version it builds on (`Parent`, from
`find_parent`), the work folder `<run>/refresh/.v<k>.partial/`, the run's `sid` facts and
codebooks hash, and the log. Also the names every step agrees on (files in the work folder,
Ray Train run names) and `RefreshError` / `RefreshResult`.

What it does not know: which version is current (`gti.run.versions`), how a step does its
work, Ray, training.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from gti import config as C
from gti.config.io import apply_overrides, read_yaml
from gti.common.errors import ConfigError, GtiError
from gti.run.manifest import MANIFEST_NAME, Manifest, ManifestError
from gti.train.ray_train import STORAGE_DIR

STEPS_FILE = "_steps.json"
FINGERPRINT_FILE = "_fingerprint"
RAY_DIR = STORAGE_DIR  # gti.train.ray_train.STORAGE_DIR
GROUND_RUN = "refresh_ground"
SFT_RUN = "refresh_sft"
NEEDS_NEW_TOKENS = "needs_new_tokens.json"
GROWN_MODEL = "grown_model"  # the parent's model + the added code tokens (tokens step)


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


def log_default(msg: str) -> None:
    from gti.common.redact import redact_text  # a data URI's credentials never reach the log

    print(f"[refresh] {redact_text(msg)}", file=sys.stderr, flush=True)


def read_manifest(run_dir: Path, stage: str) -> Manifest:
    """The manifest of a finished stage of the run; RefreshError when it has not completed."""
    if not (run_dir / stage / MANIFEST_NAME).is_file():
        raise RefreshError(f"{run_dir}: stage '{stage}' has not completed; refresh needs a trained run "
                           "(ingest, embed, sid, pairs and ground or sft)")
    return Manifest.read(run_dir / stage)


def load_run_config(run_dir: Path, items: str, interactions: str | None, overrides: Sequence[str] = (),
                    trust_remote_code: bool = False, note: Callable[[str], None] | None = None) -> C.RunConfig:
    """The config the run's model was trained with (`<run>/sft/config.yaml`, else ground's, else
    `<run>/config.yaml`) + overrides, reading the new files. `model.trust_remote_code` is the
    caller's `trust_remote_code` (`--trust-remote-code`), never the run folder's: a `true`
    there is ignored with one `note` line, and an override of it is refused."""
    from gti.run.loaded import with_trust_remote_code

    path = next((p for p in (run_dir / "sft" / "config.yaml", run_dir / "ground" / "config.yaml")
                 if p.is_file()), run_dir / "config.yaml")
    if any(str(o).split("=", 1)[0].strip() == "model.trust_remote_code" for o in overrides):
        raise ConfigError("model.trust_remote_code: not a refresh override; pass --trust-remote-code")
    raw = read_yaml(path) if path.is_file() else {}
    raw = apply_overrides(raw, list(overrides), str(path)) if overrides else raw
    data = raw.setdefault("data", {})
    data.setdefault("items", {})["path"] = str(items)
    if interactions is not None:
        data.setdefault("interactions", {})["path"] = str(interactions)
    data["max_items"] = None  # caps of the run's catalog read never cut the new items
    data["max_users"] = None
    raw["run_dir"] = str(run_dir)
    return with_trust_remote_code(C.validate(raw, f"{path} (refresh)"), trust_remote_code, str(path), note)


@dataclass
class Parent:
    """What the refresh builds on: the newest version of the run (a refresh, else the run)."""

    k: int  # 0 = the run itself
    map_path: Path
    hash: str
    model_dir: Path
    interactions_path: Path
    pair_files: list[Path]
    codebook_sizes: tuple[int, ...]  # of the parent's map (its version record, else the sid stage's)
    # The run's current base (`gti.run.versions.base_record`: model stage output, SID map),
    # recorded in the new version's manifest; a version made on another base is no parent.
    base: dict = field(default_factory=dict)
    # The sequences beside `interactions_path` (None: not recorded) and the split facts of
    # what wrote them (the run's ingest `split`, a refresh's `ingest.split`; None: not recorded).
    sequences_path: Path | None = None
    sequences_split: dict | None = None


def find_parent(run_dir: Path, note: Callable[[str], None] | None = None) -> Parent:
    """The version `gti.run.versions.resolve` names for `run_dir` (the newest refresh made on its
    current base, else the run; one `note` line for each one skipped: made on another base), with
    its map's codebook sizes (an earlier refresh may have grown them) and that base, every earlier
    refresh's new pairs and the newest interactions of those versions, with their sequences and
    split facts; RefreshError when the run lacks a stage or a trained model."""
    from gti.run.versions import RunDirError, resolve

    read_manifest(run_dir, "sid")
    pairs = read_manifest(run_dir, "pairs")
    ing = read_manifest(run_dir, "ingest")
    try:
        at = resolve(run_dir, None, **({"note": note} if note is not None else {}))
    except RunDirError as err:
        raise RefreshError(str(err)) from None
    pair_files = [pairs.output(run_dir / "pairs", "pairs")]
    inter = ing.output(run_dir / "ingest", "interactions")
    seqs = ing.output(run_dir / "ingest", "sequences") if "sequences" in ing.outputs else None
    split = ing.facts.get("split")
    for v in at.refreshes:
        if (v.dir / "pairs_new.parquet").is_file():
            pair_files.append(v.dir / "pairs_new.parquet")
        if (v.dir / "ingest" / "interactions.parquet").is_file():
            inter, seqs = v.dir / "ingest" / "interactions.parquet", v.sequences_path
            split = _ingest_split(v.dir)
    return Parent(at.k, at.map_path, at.map_hash, at.model_dir, inter, pair_files, at.codebook_sizes, at.base,
                  seqs, split)


def _ingest_split(version_dir: Path) -> dict | None:
    """The split facts a refresh version's ingest step recorded (None: none, or no manifest)."""
    try:
        return (Manifest.read(version_dir).facts.get("ingest") or {}).get("split")
    except ManifestError:
        return None


@dataclass
class Job:
    """One refresh attempt: version `k` of `run_dir`, built on `parent`, written in `work`.
    Some of it reads what a step wrote: `map_facts` after the assign step, `base_model_dir` and
    `token_range` after the tokens step."""

    run_dir: Path
    cfg: C.RunConfig
    parent: Parent
    work: Path
    k: int
    sf: dict  # the run's `sid` facts (codebook sizes, token format, levels, ...)
    cb_hash: str  # codebooks_hash of the run's codebooks
    log: Callable[[str], None]
    interactions_given: bool

    def assigned(self) -> list[str]:
        """The new items the assign step gave a SID (in input order)."""
        return json.loads((self.work / "sid" / "new_items.json").read_text())["assigned"]

    def map_facts(self) -> dict:
        """The run's `sid` facts with the codebook sizes of the new map (its version record,
        written by the assign step): what `SidCodec.from_facts` spells the new map with."""
        from gti.sid.versions import read_version

        v = read_version(self.work / "sid" / "sid_map.parquet")
        if v is None:
            raise RefreshError(f"{self.work}/sid/sid_map.parquet: no version record (the assign step has not run)")
        return dict(self.sf, codebook_sizes=list(v.codebook_sizes))

    @property
    def base_model_dir(self) -> Path:
        """The model the training steps start from: `<work>/grown_model/` (the parent's with the
        added code tokens) when the tokens step made one, else the parent's."""
        grown = self.work / GROWN_MODEL
        return grown if (grown / "config.json").is_file() else self.parent.model_dir

    def token_range(self) -> tuple[int, int]:
        """[first, end) of the SID rows of `base_model_dir` (the trainable rows): the pairs
        stage's `new_token_ids`, extended to the end its `gti_meta.json` records when a refresh
        appended code tokens after them."""
        from gti.lm.new_rows import read_meta

        first, end = (int(x) for x in Manifest.read(self.run_dir / "pairs").facts["new_token_ids"])
        recorded = read_meta(self.base_model_dir).get("new_token_ids")
        if recorded and int(recorded[0]) == first:
            end = max(end, int(recorded[1]))
        return first, end

    def tokenizer(self):
        """The tokenizer of `base_model_dir` (pad = eos when it has none)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.base_model_dir),
                                            trust_remote_code=self.cfg.model.trust_remote_code)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
