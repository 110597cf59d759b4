"""One loaded run: a trained model folder with its tokenizer, the SID map it was trained on,
the catalog's SID trie and the prompt renderer, checked against each other.

What it is for: `LoadedRun.open(run_dir)` (what `gti recommend` needs: the newest exported
model, `sft/model` else `ground/model`, located through the stage manifests; the `sid` stage's
map; titles from `ingest`; the config the model stage ran with) and `LoadedRun.open(model_dir=,
sid_map_path=, sid_facts=, cfg=)` (what the evaluate stage's actors need: the folders named by
the stage context). Either way the SID map is checked against the model first
(`LoadedRun.check_map`, `gti.sid.lineage.check_model_map`): it must be the map the model's
`gti_meta.json` records, or one that descends from it (a `gti refresh` version: same
codebooks, old items unchanged); a model trained on an unrelated map would name the wrong
items, a `StaleSidMapError` naming both hashes, never a silent mismatch. After `gti refresh`,
`open(run_dir)` takes the newest version (`<run_dir>/refresh/v<k>/`: its map, model and new
items' titles) so a new item can be recommended; `version=0` is the run before any refresh.
The codec that spells the map is the `sid` stage's, with the codebook sizes of the map's version
record when it has one (`map_codec`: a refresh with `refresh.on_full_group: add_tokens` grows
the last level), and the model's tokenizer must hold every one of its tokens (else
`MissingSidTokensError`, one line naming them). The sft stage keeps the strict `check_sid_map`
(exact hash). `recommend(run_dir, history, k)` and
`cli_main` are `gti recommend` (decoding through `gti.eval.recommend.top_k`).

Refresh versions belong to a base: each records the model stage output and SID map it was
made on (`base_record`: the model stage's manifest fingerprint and creation time, the sid map
hash); `current_versions` / `chosen_version` skip one made on another base (the run retrained
since) with one line, so the newest version is never an old model on a new run.
`trust_remote_code` is the caller's flag, never the run folder's config (`with_trust_remote_code`).

Weights load from safetensors only; fp32 on CPU, bf16 on CUDA (or where `model.dtype` says).

What it does NOT know: training, metrics, or Ray. It reads the run's files and config only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import polars as pl

from gti import config as C
from gti.errors import GtiError
from gti.manifest import MANIFEST_NAME, Manifest
from gti.sid import lineage
from gti.sid.versions import MissingSidTokensError, UnrelatedSidMapError

MODEL_STAGES = ("sft", "ground")


# The model folder was trained with a SID map that the map in use is not, and does not
# descend from (one error class for the strict check and gti.sid.lineage.check_model_map).
StaleSidMapError = UnrelatedSidMapError


class RunDirError(GtiError):
    """The run directory lacks what `recommend` needs (a model, a SID map)."""


def find_model_dir(run_dir: Path) -> tuple[str, Path]:
    """(stage, folder) of the newest exported model: sft, else ground."""
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


def with_trust_remote_code(cfg: C.RunConfig, flag: bool, where: str, note=None) -> C.RunConfig:
    """`cfg` with `model.trust_remote_code` = the caller's `flag`: a run folder (often on shared
    storage) never decides whether a model's own code runs; a `true` read from `where` while
    the flag is off is ignored with one `note` line."""
    if cfg.model.trust_remote_code and not flag:
        (note or _note)(f"{where}: model.trust_remote_code: true is ignored (a run folder never enables a "
                        "model's own code; pass --trust-remote-code to allow it)")
    if cfg.model.trust_remote_code == flag:
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"trust_remote_code": flag})})


def run_config(run_dir: Path, stage: str) -> C.RunConfig:
    """The config the model stage ran with (its config.yaml), else the run's, else defaults."""
    for path in (run_dir / stage / "config.yaml", run_dir / "config.yaml"):
        if path.is_file():
            return C.load(path)
    return C.RunConfig()


def catalog_titles(run_dir: Path, upto: "lineage.RunVersion | None" = None) -> dict[str, str]:
    """item_id -> title from the run's ingest stage ({} without one), plus the new items of
    the refresh versions up to `upto`."""
    paths = []
    ingest = run_dir / "ingest"
    if (ingest / MANIFEST_NAME).is_file():
        man = Manifest.read(ingest)
        if "items" in man.outputs:
            paths.append(man.output(ingest, "items"))
    if upto is not None:  # the versions `upto` builds on (made on the same base)
        paths += [v.items_path for v in current_versions(run_dir, note=lambda line: None)
                  if v.k <= upto.k and v.items_path.is_file()]
    out: dict[str, str] = {}
    for path in paths:
        items = pl.read_parquet(path, columns=["item_id", "title"])
        out.update(zip(items["item_id"].to_list(), (t or "" for t in items["title"].to_list())))
    return out


def map_codec(sid_map_path: Path, sid_facts: dict):
    """The `SidCodec` of the map file: the `sid` stage's (`sid_facts`), with the codebook sizes
    of the map's version record when it has one (a refresh may have grown the last level)."""
    from gti.sid.codec import SidCodec
    from gti.sid.versions import read_version

    facts = dict(sid_facts)
    version = read_version(sid_map_path)
    if version is not None and len(version.codebook_sizes) == int(facts["levels"]):
        facts["codebook_sizes"] = list(version.codebook_sizes)
    return SidCodec.from_facts(facts)


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


# --------------------------------------------------------------------------- refresh bases
BASE_FACT = "base"  # in a refresh version's manifest facts: the base it was made on
_noted: set[str] = set()


def _note(line: str) -> None:
    """One stderr line per process and message (a server re-resolving versions says it once)."""
    import sys

    if line not in _noted:
        _noted.add(line)
        print(f"gti: note: {line}", file=sys.stderr, flush=True)


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


def stale_reason(v: "lineage.RunVersion", base: dict[str, Any]) -> str | None:
    """Why version `v` does not belong to the run's current `base`, or None when it does. A
    version written before gti recorded bases has nothing to compare and is kept."""
    import json

    try:
        rec = (json.loads((v.dir / MANIFEST_NAME).read_text()).get("facts") or {}).get(BASE_FACT)
    except (OSError, ValueError, AttributeError):
        rec = None
    if not isinstance(rec, dict) or all(rec.get(k) == base[k] for k in base):
        return None
    return (f"{v.dir} is skipped: it was refreshed from another base of this run ({_describe(rec)}; "
            f"the run now has {_describe(base)})")


def current_versions(run_dir: Path, note=_note) -> "list[lineage.RunVersion]":
    """The finished refresh versions made on the run's current base, oldest first; each one
    made on another base (the run retrained since) is skipped with one `note` line."""
    vs = lineage.versions(run_dir)
    if not vs:
        return []
    base = base_record(run_dir)
    out = []
    for v in vs:
        why = stale_reason(v, base)
        if why is None:
            out.append(v)
        else:
            note(why)
    return out


def chosen_version(run_dir: Path, version: int | None, note=_note) -> "lineage.RunVersion | None":
    """The refresh version a loaded run uses: None = the newest made on the run's current base
    if any (else the run's own stages), 0 = the run's own stages, k = `<run_dir>/refresh/v<k>/`
    (refused with one line when made on another base)."""
    if version == 0:
        return None
    vs = current_versions(run_dir, note=lambda line: None if version is not None else note(line))
    if version is None:
        return vs[-1] if vs else None
    for v in vs:
        if v.k == version:
            return v
    for v in lineage.versions(run_dir):
        if v.k == version:
            raise RunDirError(str(stale_reason(v, base_record(run_dir))).replace(" is skipped:", " cannot be used:"))
    raise RunDirError(f"{run_dir}: no finished refresh version {version} "
                      f"(have: {', '.join(f'v{v.k}' for v in vs) or 'none'})")


@dataclass
class LoadedRun:
    """A model with everything needed to decode items from it (see the module docstring)."""

    model_dir: Path
    model: Any
    tokenizer: Any
    cfg: C.RunConfig
    item_ids: list[str]  # trie row i = item_ids[i]
    sids: list[str]
    sid_ids: dict[str, np.ndarray]  # item_id -> int64[L] SID token ids
    sid_matrix: Any  # LongTensor [N, L]: the trie's rows (and score_catalog's columns)
    trie: Any
    renderer: Any
    pad_id: int
    levels: int
    run_dir: Path | None = None
    model_stage: str | None = None
    titles: dict[str, str] = field(default_factory=dict)

    @property
    def max_history(self) -> int:
        return self.cfg.data.max_history

    @property
    def beam_width(self) -> int:
        return self.cfg.eval.beam_width

    @staticmethod
    def check_map(model_dir: Path, sid_map_hash: str, map_path: Path | None = None,
                  run_dir: Path | None = None) -> int:
        """The check before decoding: the map (hash `sid_map_hash`, file `map_path`) is the one
        the model's `gti_meta.json` records or descends from it (a refreshed version: same
        codebooks, old items unchanged; `gti.sid.lineage.check_model_map`); else
        StaleSidMapError naming both hashes. Returns the versions between them (0 = same)."""
        return lineage.check_model_map(
            model_dir, sid_map_hash, map_path=map_path,
            lineage=lineage.lineage_dir(run_dir) if run_dir is not None else None,
        )

    @staticmethod
    def check_sid_map(model_dir: Path, sid_map_hash: str) -> None:
        """StaleSidMapError unless `model_dir/gti_meta.json` records exactly `sid_map_hash`
        (the sft stage trains on top of a model only with the very map it was made with)."""
        from gti.lm.vocab import read_meta

        got = read_meta(model_dir).get("sid_map_hash")
        if got != sid_map_hash:
            raise StaleSidMapError(
                f"{model_dir}/gti_meta.json has sid_map_hash {got or '<none recorded>'} but the sid stage's "
                f"sid_map_hash is {sid_map_hash}: stale SID map, rerun the stages after 'sid'"
            )

    @classmethod
    def open(cls, run_dir: str | Path | None = None, *, model_dir: str | Path | None = None,
             sid_map_path: str | Path | None = None, sid_facts: dict | None = None,
             cfg: C.RunConfig | None = None, device: Any = None, version: int | None = None,
             trust_remote_code: bool | None = None) -> "LoadedRun":
        """Load a run from `run_dir`, or from an explicit model folder, SID map file, sid
        facts and config; the SID map is checked (`check_map`) before the model is loaded.

        With `run_dir`: version None = the newest `gti refresh` version if the run has one
        (its map, model and new items' titles), 0 = the run's own stages, k = refresh v<k>;
        `model_dir` then pairs another model with that map (accepted if the map descends
        from the model's). `trust_remote_code` is the caller's word: with `run_dir` the run
        folder's config never decides it (None = off; a `true` there is ignored with one note);
        with an explicit `cfg` (the caller's own config) a given value replaces the config's."""
        stage, titles, map_hash = None, {}, None
        if run_dir is not None:
            run_dir = Path(run_dir).expanduser().resolve()
            if not run_dir.is_dir():
                raise RunDirError(f"run directory not found: {run_dir}")
            sid_dir = run_dir / "sid"
            if not (sid_dir / MANIFEST_NAME).is_file():
                raise RunDirError(f"{run_dir}: no finished sid stage ({sid_dir / MANIFEST_NAME} missing)")
            sid_man = Manifest.read(sid_dir)
            sid_facts = sid_man.facts
            chosen = chosen_version(run_dir, version)
            if chosen is None:
                stage, found = find_model_dir(run_dir) if model_dir is None else ("sft", None)
                sid_map_path, map_hash = sid_man.output(sid_dir, "sid_map"), sid_facts["sid_map_hash"]
            else:
                stage, found = f"{lineage.REFRESH_DIR}/v{chosen.k}", chosen.model_dir
                sid_map_path, map_hash = chosen.map_path, chosen.version().hash
            model_dir = Path(model_dir).expanduser().resolve() if model_dir is not None else found
            cfg = with_trust_remote_code(run_config(run_dir, stage), bool(trust_remote_code), f"{run_dir} config")
            titles = catalog_titles(run_dir, chosen)
        if model_dir is None or sid_map_path is None or sid_facts is None:
            raise RunDirError("LoadedRun.open needs a run_dir, or model_dir, sid_map_path and sid_facts")
        model_dir = Path(model_dir)
        cls.check_map(model_dir, map_hash or sid_facts["sid_map_hash"], Path(sid_map_path), run_dir)
        cfg = cfg or C.RunConfig()
        if trust_remote_code is not None and run_dir is None:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"trust_remote_code": trust_remote_code})})
        return cls._load(model_dir, Path(sid_map_path), sid_facts, cfg, device,
                         run_dir=run_dir, model_stage=stage, titles=titles)

    @classmethod
    def _load(cls, model_dir: Path, sid_map_path: Path, sid_facts: dict, cfg: C.RunConfig, device: Any,
              **where: Any) -> "LoadedRun":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gti.eval.decode import override_generation_config
        from gti.lm import templates
        from gti.sid.trie import SidTrie

        trc = cfg.model.trust_remote_code
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trc)
        codec = map_codec(sid_map_path, sid_facts)
        check_tokens(tok, codec, model_dir, sid_map_path)  # before the weights load
        # model.dtype is honoured; on CUDA inference is bf16 either way.
        bf16 = dev.type == "cuda" or cfg.model.dtype == "bfloat16"
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), use_safetensors=True, trust_remote_code=trc,
            dtype=torch.bfloat16 if bf16 else torch.float32,
        ).to(dev).eval()
        override_generation_config(model)
        sid_map = pl.read_parquet(sid_map_path)
        sid_ids = templates.sid_id_table(sid_map, codec, tok)
        item_ids = sid_map["item_id"].to_list()
        mat = torch.from_numpy(np.stack([sid_ids[i] for i in item_ids]))
        sids = sid_map["sid"].to_list() if "sid" in sid_map.columns else codec.to_strings(sid_map["codes"].to_list())
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return cls(
            model_dir=model_dir, model=model, tokenizer=tok, cfg=cfg, item_ids=item_ids, sids=sids,
            sid_ids=sid_ids, sid_matrix=mat, trie=SidTrie(mat, int(mat.min()), int(mat.max()) + 1).to(dev),
            renderer=templates.make_renderer(tok, sid_ids, cfg.pairs.system_prompt, cfg.sft.max_len,
                                             prompt_style=cfg.sft.prompt_style),
            pad_id=int(pad if pad is not None else 0), levels=int(mat.shape[1]), **where,
        )

    def recommend(self, history: Sequence[str], k: int = 10) -> list[dict[str, Any]]:
        """Top-k items for `history` (item ids, oldest first), best first:
        [{"item_id", "title", "score", "sid"}]; score = sum of the SID tokens' log-probs."""
        from gti.eval.recommend import top_k

        return top_k(self, history, k, where=f"{self.run_dir or self.model_dir}/sid")


def check_sid_map_hash(model_dir: Path, sid_map_hash: str) -> None:
    """`LoadedRun.check_sid_map` (for the stages that check before they load anything)."""
    LoadedRun.check_sid_map(Path(model_dir), sid_map_hash)


def load_recommender(run_dir: str | Path, device: str | None = None, *, version: int | None = None,
                     model_dir: str | Path | None = None) -> LoadedRun:
    """`LoadedRun.open(run_dir, ...)`: model, tokenizer, SID map and titles of a finished run
    (the newest refresh version by default; see `LoadedRun.open`)."""
    return LoadedRun.open(run_dir, device=device, version=version, model_dir=model_dir)


def recommend(run_dir: str | Path, history: Sequence[str], k: int = 10) -> list[dict[str, Any]]:
    """Top-k items [{"item_id", "title", "score", "sid"}] for `history` (oldest first)."""
    return LoadedRun.open(run_dir).recommend(history, k)


def cli_main(args) -> int:
    """`gti recommend`: args.run_dir, args.history (comma-separated ids), args.k."""
    from gti.eval.recommend import format_recommendations

    history = [h.strip() for h in str(args.history).split(",") if h.strip()]
    run = LoadedRun.open(args.run_dir, version=getattr(args, "version", None),
                         trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    recs = run.recommend(history, int(args.k))
    print(f"run {run.run_dir} (model: {run.model_stage}), history: {', '.join(history)}")
    print(format_recommendations(recs))
    return 0
