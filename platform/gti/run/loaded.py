"""One loaded run: a trained model with its tokenizer, the SID map it decodes with, the
catalog's SID trie, the titles and the prompt renderer.

What it is for: `LoadedRun.open(run_dir, version=)` (what `gti recommend`, `gti serve` and
`gti infer` load) and `LoadedRun.open(model_dir=, sid_map_path=, sid_facts=, cfg=)` (what the
evaluate stage's actors load). Either way the map is checked against the model, and the
tokenizer against the map's codec, before anything loads. `recommend(run_dir, history, k)` and
`cli_main` are `gti recommend` (decoding through `gti.eval.recommend.top_k`).
`trust_remote_code` is the caller's flag, never the run folder's config.

What it does NOT know: which version of a run is current or whether a map fits a model
(`gti.run.versions`), training, metrics, Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import polars as pl

from gti import config as C
from gti.run.manifest import MANIFEST_NAME, Manifest
from gti.run.versions import (
    RefreshVersion, ResolvedVersion, RunDirError, check_model_map, check_tokens, lineage_dir, note_once, resolve,
)


def with_trust_remote_code(cfg: C.RunConfig, flag: bool, where: str, note=None) -> C.RunConfig:
    """`cfg` with `model.trust_remote_code` = the caller's `flag`: a run folder (often on shared
    storage) never decides whether a model's own code runs; a `true` read from `where` while
    the flag is off is ignored with one `note` line."""
    if cfg.model.trust_remote_code and not flag:
        (note or note_once)(f"{where}: model.trust_remote_code: true is ignored (a run folder never enables a "
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


def catalog_titles(run_dir: Path, refreshes: Sequence[RefreshVersion] = ()) -> dict[str, str]:
    """item_id -> title from the run's ingest stage ({} without one), plus the new items of
    `refreshes` (the refresh versions a loaded version builds on, `ResolvedVersion.refreshes`)."""
    paths = []
    ingest = run_dir / "ingest"
    if (ingest / MANIFEST_NAME).is_file():
        man = Manifest.read(ingest)
        if "items" in man.outputs:
            paths.append(man.output(ingest, "items"))
    paths += [v.items_path for v in refreshes if v.items_path.is_file()]
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


@dataclass
class LoadedRun:
    """A model with everything needed to decode items from it: model and tokenizer, SID map,
    trie, titles (from `ingest` and the loaded version's refreshes' new items), renderer, and
    the config the model stage ran with. Weights load from safetensors only; fp32 on CPU, bf16
    on CUDA (or where `model.dtype` says)."""

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
    resolved: ResolvedVersion | None = None  # the run version it was opened at (None: named folders)

    @property
    def max_history(self) -> int:
        return self.cfg.data.max_history

    @property
    def beam_width(self) -> int:
        return self.cfg.eval.beam_width

    @property
    def normalise(self) -> str:
        """How beam scores are normalised (`eval.normalise`): recommend and serve rank as evaluate did."""
        return self.cfg.eval.normalise

    @classmethod
    def open(cls, run_dir: str | Path | None = None, *, model_dir: str | Path | None = None,
             sid_map_path: str | Path | None = None, sid_facts: dict | None = None,
             cfg: C.RunConfig | None = None, device: Any = None, version: int | None = None,
             trust_remote_code: bool | None = None) -> "LoadedRun":
        """Load a run from `run_dir`, or from an explicit model folder, SID map file, sid
        facts and config; the SID map is checked (`gti.run.versions.check_model_map`: that map
        or one that descends from it, else one line naming both hashes) before the model is
        loaded, and the tokenizer against the map's codec (`gti.run.versions.check_tokens`;
        the codec is `map_codec`'s).

        With `run_dir`: `version` as `gti.run.versions.resolve` takes it (None = the newest
        refresh made on the run's current base, else the run's own stages; 0 = the run's own
        stages; k = refresh v<k>); `model_dir` then pairs another model with that map (accepted
        if the map descends from the model's). `trust_remote_code` is the caller's word: with
        `run_dir` the run folder's config never decides it (None = off; a `true` there is
        ignored with one note); with an explicit `cfg` (the caller's own config) a given value
        replaces the config's."""
        stage, titles, map_hash, resolved = None, {}, None, None
        if run_dir is not None:
            resolved = resolve(run_dir, version, find_model=model_dir is None)
            run_dir, sid_facts, sid_map_path = resolved.run_dir, resolved.sid.facts, resolved.map_path
            stage, map_hash = resolved.stage or "sft", resolved.map_hash
            model_dir = Path(model_dir).expanduser().resolve() if model_dir is not None else resolved.model_dir
            cfg = with_trust_remote_code(run_config(run_dir, stage), bool(trust_remote_code), f"{run_dir} config")
            titles = catalog_titles(run_dir, resolved.refreshes)
        if model_dir is None or sid_map_path is None or sid_facts is None:
            raise RunDirError("LoadedRun.open needs a run_dir, or model_dir, sid_map_path and sid_facts")
        model_dir = Path(model_dir)
        check_model_map(model_dir, map_hash or sid_facts["sid_map_hash"], map_path=Path(sid_map_path),
                        lineage=lineage_dir(run_dir) if run_dir is not None else None)
        cfg = cfg or C.RunConfig()
        if trust_remote_code is not None and run_dir is None:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"trust_remote_code": trust_remote_code})})
        return cls._load(model_dir, Path(sid_map_path), sid_facts, cfg, device,
                         run_dir=run_dir, model_stage=stage, titles=titles, resolved=resolved)

    @classmethod
    def _load(cls, model_dir: Path, sid_map_path: Path, sid_facts: dict, cfg: C.RunConfig, device: Any,
              **where: Any) -> "LoadedRun":
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gti.eval.generate import override_generation_config
        from gti.lm import templates
        from gti.sid.trie import SidTrie

        trc = cfg.model.trust_remote_code
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trc)
        codec = map_codec(sid_map_path, sid_facts)
        check_tokens(tok, codec, model_dir, sid_map_path)  # before the weights load
        check_render_style(model_dir, cfg)
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
                                             prompt_style=cfg.sft.render_style),
            pad_id=int(pad if pad is not None else 0), levels=int(mat.shape[1]), **where,
        )

    def recommend(self, history: Sequence[str], k: int = 10, *,
                  exclude_history: bool = False) -> list[dict[str, Any]]:
        """Top-k items for `history` (item ids, oldest first), best first:
        [{"item_id", "title", "score", "sid"}]; score = sum of the SID tokens' log-probs.
        `exclude_history`: leave the history's items out (`gti serve`'s default; off here)."""
        from gti.eval.recommend import top_k

        return top_k(self, history, k, where=f"{self.run_dir or self.model_dir}/sid", exclude_history=exclude_history)


def check_render_style(model_dir: Path, cfg: C.RunConfig) -> None:
    """ConfigError when the model was trained on prompts rendered otherwise than `cfg` would
    render them (`render_style` in its gti_meta.json: "chat", "compact" or "sequence"): a model
    fine-tuned on one form scores another form's prompts as noise. Models exported before the
    style was recorded carry none and are not checked."""
    from gti.common.errors import ConfigError
    from gti.lm.new_rows import read_meta

    trained = read_meta(model_dir).get("render_style")
    if trained is not None and trained != cfg.sft.render_style:
        raise ConfigError(
            f"{model_dir}: the model was trained on '{trained}' prompts but the config renders "
            f"'{cfg.sft.render_style}' (sft.objective={cfg.sft.objective}, sft.prompt_style={cfg.sft.prompt_style}); "
            "use the config the model was trained with"
        )


def load_recommender(run_dir: str | Path, device: str | None = None, *, version: int | None = None,
                     model_dir: str | Path | None = None) -> LoadedRun:
    """`LoadedRun.open(run_dir, ...)`: model, tokenizer, SID map and titles of a finished run
    (the newest refresh version by default; see `LoadedRun.open`)."""
    return LoadedRun.open(run_dir, device=device, version=version, model_dir=model_dir)


def recommend(run_dir: str | Path, history: Sequence[str], k: int = 10) -> list[dict[str, Any]]:
    """Top-k items [{"item_id", "title", "score", "sid"}] for `history` (oldest first)."""
    return LoadedRun.open(run_dir).recommend(history, k)


def cli_main(args) -> int:
    """`gti recommend`: args.run_dir, args.history (comma-separated ids), args.k, args.exclude_history."""
    from gti.eval.recommend import format_recommendations

    history = [h.strip() for h in str(args.history).split(",") if h.strip()]
    run = LoadedRun.open(args.run_dir, version=getattr(args, "version", None),
                         trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    recs = run.recommend(history, int(args.k), exclude_history=bool(getattr(args, "exclude_history", False)))
    print(f"run {run.run_dir} (model: {run.model_stage}), history: {', '.join(history)}")
    print(format_recommendations(recs))
    return 0
