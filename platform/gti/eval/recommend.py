"""Top-K recommendations for one item history, from a finished run directory.

What it is for: `gti recommend --run-dir R --history ID[,ID...] [--k 10]` and the Python
function `recommend(run_dir, history, k)`. It loads the exported model folder
(`run_dir/sft/model`, falling back to `run_dir/ground/model`, located through the stage
manifests; the tokenizer is saved in the same folder, weights from safetensors only), the SID
map of the `sid` stage (through its manifest) and, when the ingest stage is there, item titles.
Before decoding it checks the SID map against the model (`gti.sid.lineage.check_model_map`):
the map the model's `gti_meta.json` records, or one that descends from it (a refreshed version:
same codebooks, old items unchanged). A model trained on an unrelated SID map would name the
wrong items, so that is a `StaleSidMapError` naming both hashes, never a silent mismatch.

After `gti refresh` the newest version is the default (`<run_dir>/refresh/v<k>/`: its map,
its model, the titles of its new items), so a new item can be recommended; `version=0` (CLI
`--version 0`) goes back to the run's own sid stage and model, `version=k` picks one, and
`model_dir=` pairs any model with the chosen map (accepted only if the map descends from it).

The prompt is rendered exactly as the evaluate stage renders it (first retrieval template,
the run's system prompt, the newest `data.max_history` items, cut to `sft.max_len`), and the
items are decoded with `gti.eval.decode.constrained_beam_search` over the catalog's SID trie
(beam width = max(k, eval.beam_width)).

What it does NOT know: training, metrics, or Ray. It reads the run's files and config only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import polars as pl

from gti import config as C
from gti.errors import DataError, GtiError
from gti.manifest import MANIFEST_NAME, Manifest
from gti.sid.versions import UnrelatedSidMapError

MODEL_STAGES = ("sft", "ground")


# The model folder was trained with a SID map that the map in use does not descend from
# (issue 15: one error class for the strict check below and gti.sid.lineage.check_model_map).
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


def check_sid_map_hash(model_dir: Path, sid_map_hash: str) -> None:
    """StaleSidMapError unless `model_dir/gti_meta.json` records `sid_map_hash`."""
    from gti.lm.vocab import read_meta

    got = read_meta(model_dir).get("sid_map_hash")
    if got != sid_map_hash:
        raise StaleSidMapError(
            f"{model_dir}/gti_meta.json has sid_map_hash {got or '<none recorded>'} but the sid stage's "
            f"sid_map_hash is {sid_map_hash}: stale SID map, rerun the stages after 'sid'"
        )


def _run_config(run_dir: Path, stage: str) -> C.RunConfig:
    """The config the model stage ran with (its config.yaml), else the run's, else defaults."""
    for path in (run_dir / stage / "config.yaml", run_dir / "config.yaml"):
        if path.is_file():
            return C.load(path)
    return C.RunConfig()


def _titles(run_dir: Path, upto=None) -> dict[str, str]:
    """Titles of the run's items, plus those of the new items of refresh versions up to `upto`."""
    from gti.sid import lineage

    paths = []
    ingest = run_dir / "ingest"
    if (ingest / MANIFEST_NAME).is_file():
        man = Manifest.read(ingest)
        if "items" in man.outputs:
            paths.append(man.output(ingest, "items"))
    if upto is not None:
        paths += [v.items_path for v in lineage.versions(run_dir) if v.k <= upto.k and v.items_path.is_file()]
    out: dict[str, str] = {}
    for path in paths:
        items = pl.read_parquet(path, columns=["item_id", "title"])
        out.update(zip(items["item_id"].to_list(), (t or "" for t in items["title"].to_list())))
    return out


def _chosen_version(run_dir: Path, version: int | None):
    """The refresh version `load_recommender` uses (None: the run's own stages)."""
    from gti.sid import lineage

    if version == 0:
        return None
    vs = lineage.versions(run_dir)
    if version is None:
        return vs[-1] if vs else None
    for v in vs:
        if v.k == version:
            return v
    raise RunDirError(f"{run_dir}: no finished refresh version {version} "
                      f"(have: {', '.join(f'v{v.k}' for v in vs) or 'none'})")


@dataclass
class Recommender:
    """A loaded run: model, tokenizer, SID trie, renderer. Build with `load_recommender`."""

    run_dir: Path
    model_stage: str
    model_dir: Path
    model: Any
    tokenizer: Any
    trie: Any
    item_ids: list[str]
    sids: list[str]
    sid_ids: dict[str, np.ndarray]
    titles: dict[str, str]
    renderer: Any
    max_history: int
    beam_width: int
    pad_id: int
    levels: int

    def recommend(self, history: Sequence[str], k: int = 10) -> list[dict[str, Any]]:
        """Top-k items for `history` (item ids, oldest first), best first:
        [{"item_id", "title", "score", "sid"}]; score = sum of the SID tokens' log-probs."""
        from gti.eval.decode import constrained_beam_search

        history = [str(h).strip() for h in history if str(h).strip()]
        if not history:
            raise DataError("history is empty: give at least one item id")
        if k < 1:
            raise GtiError(f"k must be >= 1, got {k}")
        unknown = [h for h in dict.fromkeys(history) if h not in self.sid_ids]
        if unknown:
            raise DataError(
                f"unknown item id(s) in history: {', '.join(unknown[:10])}"
                + (f" (+{len(unknown) - 10} more)" if len(unknown) > 10 else "")
                + f"; they have no SID in {self.run_dir}/sid"
            )
        k = min(k, len(self.item_ids))
        prompt, _ = self.renderer.prompt(history[-self.max_history :])
        res = constrained_beam_search(
            self.model, [prompt], self.trie, beam_width=max(k, self.beam_width), k=k,
            levels=self.levels, pad_id=self.pad_id, constrained=True, batch_users=1,
        )
        out = []
        for row, score in zip(res.items[0].tolist(), res.scores[0].tolist()):
            if row < 0:
                continue
            item = self.item_ids[row]
            out.append({"item_id": item, "title": self.titles.get(item, ""), "score": float(score),
                        "sid": self.sids[row]})
        return out


def load_recommender(run_dir: str | Path, device: str | None = None, *, version: int | None = None,
                     model_dir: str | Path | None = None) -> Recommender:
    """Load model, tokenizer, SID map and titles of a run (checks the SID map first).

    version: None = the newest refresh version if the run has one, else the run itself;
        0 = the run's own sid stage and model; k = `<run_dir>/refresh/v<k>/`.
    model_dir: use this model folder with that version's map (e.g. the run's model with a
        refreshed map: accepted because the map descends from the model's).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gti.eval.decode import override_generation_config
    from gti.sid.codec import SidCodec
    from gti.sid.trie import SidTrie
    from gti.train import sft_data

    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise RunDirError(f"run directory not found: {run_dir}")
    from gti.sid import lineage

    sid_dir = run_dir / "sid"
    if not (sid_dir / MANIFEST_NAME).is_file():
        raise RunDirError(f"{run_dir}: no finished sid stage ({sid_dir / MANIFEST_NAME} missing)")
    sid_man = Manifest.read(sid_dir)
    chosen = _chosen_version(run_dir, version)
    if chosen is None:
        stage, found = find_model_dir(run_dir) if model_dir is None else ("sft", None)
        map_path, sid_hash = sid_man.output(sid_dir, "sid_map"), sid_man.fact("sid_map_hash")
    else:
        stage, found = f"{lineage.REFRESH_DIR}/v{chosen.k}", chosen.model_dir
        map_path, sid_hash = chosen.map_path, chosen.version().hash
    model_dir = Path(model_dir).expanduser().resolve() if model_dir is not None else found
    lineage.check_model_map(model_dir, sid_hash, map_path=map_path, lineage=lineage.lineage_dir(run_dir))

    cfg = _run_config(run_dir, stage)
    sid_map = pl.read_parquet(map_path)
    codec = SidCodec.from_facts(sid_man.facts)
    trc = cfg.model.trust_remote_code
    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trc)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), use_safetensors=True, trust_remote_code=trc,
        dtype=torch.bfloat16 if dev.type == "cuda" or cfg.model.dtype == "bfloat16" else torch.float32,
    ).to(dev).eval()
    override_generation_config(model)
    sid_ids = sft_data.sid_id_table(sid_map, codec, tok)
    item_ids = sid_map["item_id"].to_list()
    mat = torch.from_numpy(np.stack([sid_ids[i] for i in item_ids]))
    trie = SidTrie(mat, int(mat.min()), int(mat.max()) + 1).to(dev)
    sids = sid_map["sid"].to_list() if "sid" in sid_map.columns else codec.to_strings(sid_map["codes"].to_list())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return Recommender(
        run_dir=run_dir, model_stage=stage, model_dir=model_dir, model=model, tokenizer=tok,
        trie=trie, item_ids=item_ids, sids=sids, sid_ids=sid_ids, titles=_titles(run_dir, chosen),
        renderer=sft_data.make_renderer(
            tok, sid_ids, cfg.pairs.system_prompt, cfg.sft.max_len, prompt_style=cfg.sft.prompt_style
        ),
        max_history=cfg.data.max_history, beam_width=cfg.eval.beam_width,
        pad_id=int(pad if pad is not None else 0), levels=int(mat.shape[1]),
    )


def recommend(run_dir: str | Path, history: Sequence[str], k: int = 10) -> list[dict[str, Any]]:
    """Top-k items [{"item_id", "title", "score", "sid"}] for `history` (oldest first)."""
    return load_recommender(run_dir).recommend(history, k)


def format_recommendations(recs: list[dict[str, Any]], title_width: int = 60) -> str:
    """A plain-text table: rank, item id, score, SID, title."""
    id_w = max([7, *(len(r["item_id"]) for r in recs)])
    sid_w = max([3, *(len(r["sid"]) for r in recs)])
    lines = [f"{'rank':>4}  {'item_id':<{id_w}}  {'score':>9}  {'sid':<{sid_w}}  title"]
    for i, r in enumerate(recs, 1):
        title = r["title"] if len(r["title"]) <= title_width else r["title"][: title_width - 3] + "..."
        lines.append(f"{i:>4}  {r['item_id']:<{id_w}}  {r['score']:>9.4f}  {r['sid']:<{sid_w}}  {title}")
    return "\n".join(lines)


def cli_main(args) -> int:
    """`gti recommend`: args.run_dir, args.history (comma-separated ids), args.k."""
    history = [h.strip() for h in str(args.history).split(",") if h.strip()]
    rec = load_recommender(args.run_dir, version=getattr(args, "version", None))
    recs = rec.recommend(history, int(args.k))
    print(f"run {rec.run_dir} (model: {rec.model_stage}), history: {', '.join(history)}")
    print(format_recommendations(recs))
    return 0
