"""Benchmark: new items through `gti refresh` vs SIDs only vs a full retrain (issue 15, item 3).

A slice of items is held out as "new" (`gti.data.holdout.holdout_new_items`: items that end some
user's history, plus every interaction with them). A base run trains on the rest (ingest ..
sft). Then three ways to serve the new items, each timed:
- `refresh`: `gti refresh` with the new items and interactions: SIDs from the frozen quantiser,
  `refresh.ground_steps` grounding steps on the new items' pairs + replayed old pairs (and
  `refresh.sft_steps` SFT steps on the touched users' windows, 0 by default);
- `assign_only`: `gti refresh` with `refresh.ground_steps=0`: the same SIDs, no training; the
  refresh's export is the base run's model (with the added code tokens' rows, mean-initialised,
  when the new items needed some) and serves the new map;
- `retrain`: the whole pipeline again on all items (new SIDs for everything).
Scored on the test users whose target is a new item (histories from the full data's ingest:
the retrain run's first stage, run for this whenever slices.json is not recorded yet; a refresh's
merged sequences lack the users whose base history was too short to keep; the same prompts for
every arm): Recall@K of constrained beam search and MRR of the target's
exact rank among all catalog items (`gti.eval.rank`); the same on an equal sample of users whose
target is an old item, to see what the refresh costs them. Every figure has a bootstrap CI over
users, and MostPop and first-order Markov (fitted on the full data's training sequences) are
scored on the same users; paired differences (refresh - SIDs only, each - retrain, each - Markov)
come with a paired bootstrap CI over the users both scored. A markdown table of it all goes to
stderr, and the last line is one JSON object.

Modes:
- default (real figures; minutes to hours on 2 CPU cores, not run by the tests): SmolLM2-135M
  with `jobs/configs/proof-smollm2.yaml` on its documented dense subset of the bundled data
  (the 1,000 most interacted items, users with >= 5 interactions on them: `gti data dense`),
  --n-new 50 new items;
- `--quick` (a smoke test, a few minutes): `jobs/configs/tiny.yaml` (tiny random Llama, hash
  embeddings) on 300 bundled items, 12 of them new. Its figures say nothing about quality.

Usage: python bench/refresh/refresh.py [--quick] [--n-new N] [--users N] [--work DIR] [--records DIR]
                                        [--baseline-records DIR]
                                        [--arms refresh,assign_only,retrain] [key=value ...]
With `--work DIR` the bench resumes: the same command again continues the runs from their
stages and checkpoints, reuses finished refreshes and the scores already written.
With `--records DIR` (the full mode: `bench/refresh/smollm2/`, committed) every finished part
is kept there as a small JSON file: the scored users and the MostPop/Markov rows
(`slices.json`), each arm's scores per slice and its wall time. A later session on a fresh
machine, whose work folder is gone, skips what is recorded and trains only what is not: the
full mode takes ~3 h on 2 cores, more than one session, so it runs in parts, e.g. `--arms
retrain` (~75 min) in one session and `--arms refresh,assign_only` (~1 h 45 min: the base run,
both refreshes, their scores) in another. The last line is printed by every part; it says
which arms are still missing.
(overrides go to every run and refresh, e.g. refresh.ground_steps=200 refresh.sft_steps=50; ones
beyond the mode's make a variant: it refreshes its own copies of the base run, which it shares,
since the base stages do not hash the refresh section, and needs its own --records folder, as
arms record their overrides and records made with overrides that can change them are refused
(`arm_overrides`: the retrain ignores refresh.*, SIDs only the training keys). `--baseline-records
DIR` copies DIR's users, references and the arms this part does not compute into the variant's
folder, so its refresh pairs with SIDs only and the retrain recorded there.) Besides each slice,
every figure is given for all test users (`overall`: the slices weighted by the share of test
users whose target is new, `test_share`), the figure a refresh setting is judged by. A reference that knows
which items are new (MostPop over them alone) is scored on both slices too: it shows how much
a model can gain on new-target users by only moving its top K toward the new items, which each
arm's `new_share@K` (the new items' share of each user's top K) measures.
One Ray-heavy run at a time: do not run it beside the test suite on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ARMS = ("refresh", "assign_only", "retrain")
SLICES = ("new_target", "old_target")
UNCAPPED = 10**9  # a history length no user reaches: the scored histories are kept whole

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline(tokenizers=False)

CONFIGS = common.CONFIGS
QUICK = {"config": CONFIGS / "tiny.yaml", "n_new": 12, "ks": [1, 5], "users": 40, "records": None,
         "overrides": ["data.max_items=null", "ground.steps=6", "sft.steps=6", "refresh.ground_steps=6",
                       "ground.batch_size=4"]}
# Full mode: the proof config as is, except that SFT validates on val_loss alone (its exact-rank
# val_mrr costs ~10 min per SFT run and the bench reads no learning curve), and 100 users per
# slice (exact ranks cost ~4 s per user per arm on 2 cores). On this holdout 3 of the 50 new
# items land in a prefix group whose last-level codes are all taken, so the refresh adds tokens
# (`refresh.on_full_group=add_tokens`: the default since issue 51, still named here because the
# committed records list the overrides they were made with).
FULL = {"config": CONFIGS / "proof-smollm2.yaml", "n_new": 50, "ks": [1, 10], "users": 100,
        "records": Path(__file__).resolve().parent / "smollm2",
        "overrides": ["refresh.ground_steps=100", "refresh.on_full_group=add_tokens", "eval.beam_width=20",
                      "sft.val_mrr=false"]}


log = common.log


def write_data(work: Path, quick: bool, n_new: int, seed: int):
    """(base items, base interactions, new items, new interactions, all items, all interactions)
    paths and the holdout."""
    import polars as pl

    from gti.data import bundled
    from gti.data.dense import dense_subset
    from gti.data.holdout import holdout_new_items

    items = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "items"))
    inter = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "interactions"))
    if quick:
        items = items.head(300)
        inter = inter.filter(pl.col("item_id").is_in(items["item_id"].implode()))
    else:  # the proof config's dense subset: gti data dense --items 1000 --min-user-len 5
        items, inter = dense_subset(items, inter, 1000, 5)
    h = holdout_new_items(items, inter, n_new, seed=seed)
    d = work / "data"
    d.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, df in (("base_items", h.base_items), ("base_inter", h.base_interactions), ("new_items", h.new_items),
                     ("new_inter", h.new_interactions), ("all_items", items), ("all_inter", inter)):
        paths[name] = d / f"{name}.parquet"
        if not paths[name].is_file():  # a resumed bench keeps its inputs (the stages hash them)
            df.write_parquet(paths[name])
    return paths, h


def run_pipeline(config: Path, run_dir: Path, items: Path, inter: Path, overrides: list[str],
                 to_stage: str = "sft") -> float:
    from gti import config as C
    from gti.run import pipeline

    cfg = C.load(config, [f"run_dir={run_dir}", f"data.items.path={items}", f"data.interactions.path={inter}",
                          *overrides])
    pipeline.run(cfg, to_stage=to_stage, echo=log)
    return stages_wall_s(run_dir)


def variant_suffix(ov: list[str], mode: dict) -> str:
    """"" for the mode's own overrides (and seed=0), else "-<hash of the overrides>": a variant
    (e.g. refresh.ground_lr=3e-4) refreshes its own copies of the base run (the base run's
    stages do not hash the refresh section, so it is shared), never a refresh done with other
    settings."""
    import hashlib

    if ov == [*mode["overrides"], "seed=0"]:
        return ""
    return "-" + hashlib.sha256(json.dumps(ov).encode()).hexdigest()[:8]


# Refresh keys that cannot change SIDs only's result: it runs with no grounding and no SFT.
_TRAINING_KEYS = frozenset({"refresh.ground_steps", "refresh.ground_lr", "refresh.replay_ratio",
                            "refresh.sft_steps", "refresh.sft_lr"})


def arm_overrides(arm: str, ov: list[str]) -> list[str]:
    """The overrides that can change `arm`'s result: the retrain never refreshes (no `refresh.*`
    key), SIDs only forces its training steps to 0 (none of `_TRAINING_KEYS`), the refresh
    depends on all of them. A variant (e.g. refresh.ground_lr=3e-4) thus shares the recorded
    SIDs-only and retrain arms, and pairs with them on the same users."""
    if arm == "retrain":
        return [o for o in ov if not o.startswith("refresh.")]
    if arm == "assign_only":
        return [o for o in ov if o.split("=", 1)[0] not in _TRAINING_KEYS]
    return list(ov)


def seed_records(store: "Store", src: Path, arms: list[str]) -> list[str]:
    """Copy from the records folder `src` into `store` what a variant shares and `store` lacks:
    the scored users and references (slices, new_item_prior, test_share), the base run's time
    and the arms this part does not compute (their overrides are checked like any record).
    Returns the names copied."""
    names = ["slices", "new_item_prior", "test_share", "base",
             *(f"{a}{part}" for a in ARMS if a not in arms for part in ("", *(f".{sl}" for sl in SLICES)))]
    copied = []
    store.root.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (src / f"{n}.json").is_file() and not store.has(n):
            shutil.copyfile(src / f"{n}.json", store.root / f"{n}.json")
            copied.append(n)
    return copied


def stages_wall_s(run_dir: Path) -> float:
    """Wall time of a run's stages ingest .. sft from their manifests (so a bench resumed in a
    later session reports the time the stages took, not the seconds it took to find them done;
    a stage resumed from a checkpoint counts its last attempt)."""
    total = 0.0
    for stage in ("ingest", "embed", "sid", "pairs", "ground", "sft"):
        m = run_dir / stage / "_manifest.json"
        if m.is_file():
            total += float(json.loads(m.read_text()).get("duration_s") or 0.0)
    return total


def linked_copy(src: Path, dest: Path) -> Path:
    """A copy of a run made of hard links (a refresh writes only under refresh/); an existing
    copy is kept (a resumed bench: its refresh resumes or is done)."""
    if not dest.exists():
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, copy_function=os.link)
        tmp.rename(dest)
    return dest


def refresh_once(run: Path, items: Path, inter: Path, overrides: list[str]):
    """`gti refresh` of `run` with the new items, or its result when an earlier attempt of the
    bench finished it (a second call would make v2 on top of v1)."""
    from gti.refresh.command import refresh
    from gti.refresh.attempt import RefreshResult

    done = run / "refresh" / "v1" / "_manifest.json"
    if done.is_file():
        f = json.loads(done.read_text())["facts"]
        log(f"{run.name}: refresh v1 done by an earlier attempt, reused")
        return RefreshResult(k=1, dir=done.parent, parent_hash=f["parent_hash"], new_hash=f["new_hash"], facts=f)
    return refresh(run, items, inter, overrides, log=log)


def cached(path: Path, compute):
    """The JSON in `path`, else compute() written there (scores survive an interrupted bench)."""
    if path.is_file():
        return json.loads(path.read_text())
    out = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(path)
    return out


def _with_ci(per_user, n_boot: int, seed: int) -> dict:
    """{"value": mean, "ci": [lo, hi]} of per-user values (bootstrap over users)."""
    import numpy as np

    from gti.eval.metrics import bootstrap_ci

    v = np.asarray(per_user, dtype=np.float64)
    return {"value": float(v.mean()) if v.size else 0.0, "ci": list(bootstrap_ci(v, n_boot=n_boot, seed=seed))}


def score(rec, histories: list[list[str]], targets: list[str], ks: list[int], batch_users: int = 8,
          n_boot: int = 1000, seed: int = 0, new_ids: frozenset = frozenset()) -> dict:
    """Recall@K (constrained beam search) and MRR (exact rank among all items) for one model+map,
    each {"value", "ci"} over the users whose history and target the map holds; with `new_ids`,
    also `new_share@K`: the share of new items in each user's top K (how far a model's
    recommendations moved toward the new items, whatever the user's target)."""
    import numpy as np
    import torch

    from gti.eval.decode import constrained_beam_search
    from gti.eval.metrics import metrics_table
    from gti.eval.rank import exact_ranks, score_catalog

    keep = [i for i, (h, t) in enumerate(zip(histories, targets)) if t in rec.sid_ids and all(x in rec.sid_ids for x in h)]
    hist = [histories[i][-rec.max_history:] for i in keep]
    tg = [targets[i] for i in keep]
    if not tg:
        return {"n_users": 0}
    prompts = [rec.renderer.prompt(h)[0] for h in hist]
    k = max(ks)
    res = constrained_beam_search(rec.model, prompts, rec.trie, beam_width=max(k, rec.beam_width), k=k,
                                  levels=rec.levels, pad_id=rec.pad_id, batch_users=batch_users)
    ranked = [[rec.item_ids[r] for r in row if r >= 0] for row in res.items.tolist()]
    mat = torch.from_numpy(np.stack([rec.sid_ids[i] for i in rec.item_ids]))
    row_of = {it: r for r, it in enumerate(rec.item_ids)}
    scores = score_catalog(rec.model, prompts, mat, pad_id=rec.pad_id, batch_users=batch_users)
    ranks = exact_ranks(scores, torch.tensor([row_of[t] for t in tg]))
    out, per = metrics_table(ranked, tg, ks, metrics=("recall",), n_boot=n_boot, seed=seed, return_per_user=True)
    if new_ids:
        per[f"new_share@{k}"] = [sum(x in new_ids for x in row[:k]) / k for row in ranked]
        out[f"new_share@{k}"] = _with_ci(per[f"new_share@{k}"], n_boot, seed)
    rr = (1.0 / ranks).numpy()
    out.update(mrr=_with_ci(rr, n_boot, seed), median_rank=float(ranks.median()), n_users=len(tg),
               n_items=len(rec.item_ids), per_user={"user": keep, "rr": rr.tolist(), **per})
    return out


def baseline_scores(train_sequences: list[list[str]], catalog: list[str], histories: list[list[str]],
                    targets: list[str], ks: list[int], n_boot: int = 1000, seed: int = 0) -> dict:
    """MostPop and first-order Markov, fitted on `train_sequences`, on the same users as the
    arms: {"mostpop": {"recall@K": {"value", "ci"}, "mrr": ...}, "markov": ...}. Both rank the
    whole catalog, so MRR is the target's rank in it (1 / (len(catalog) + 1) when absent)."""
    import numpy as np

    from gti.eval.baselines import Markov, MostPop
    from gti.eval.metrics import metrics_table, target_ranks

    out = {}
    for name, cls in (("mostpop", MostPop), ("markov", Markov)):
        ranked = cls(catalog).fit(train_sequences).recommend(histories, len(catalog))
        r0 = target_ranks(ranked, targets)  # 0-based, -1 when absent
        ranks = np.where(r0 >= 0, r0 + 1, len(catalog) + 1).astype(float)  # absent: after the whole catalog
        row, per = metrics_table(ranked, targets, ks, metrics=("recall",), n_boot=n_boot, seed=seed,
                                 return_per_user=True)
        row["mrr"] = _with_ci(1.0 / ranks, n_boot, seed)
        row["per_user"] = {"user": list(range(len(targets))), "rr": (1.0 / ranks).tolist(), **per}
        out[name] = row
    return out


# Paired differences reported (first minus second, on the users both scored): the refresh's
# grounding against SIDs only, each way of serving new items against the full retrain, and
# the arms against first-order Markov (the stronger baseline here).
PAIRS = (("refresh", "assign_only"), ("refresh", "retrain"), ("assign_only", "retrain"), ("refresh", "markov"),
         ("retrain", "markov"))


def _paired_values(a: dict, b: dict):
    """(common users, {metric: (a's values, b's values)}) on the users both rows scored
    (`per_user`: {"user": slice indices, "rr": [...], "recall@K": [...]}; "rr" is named "mrr");
    None when a row has no per-user values (records written before they were kept)."""
    import numpy as np

    pa, pb = a.get("per_user"), b.get("per_user")
    if not pa or not pb:
        return None
    ia, ib = {u: i for i, u in enumerate(pa["user"])}, {u: i for i, u in enumerate(pb["user"])}
    both = sorted(set(ia) & set(ib))
    return both, {("mrr" if m == "rr" else m): (np.array([pa[m][ia[u]] for u in both], dtype=np.float64),
                                                  np.array([pb[m][ib[u]] for u in both], dtype=np.float64))
                  for m in pa if m != "user" and m in pb}


def paired_diff(a: dict, b: dict, n_boot: int = 1000, seed: int = 0) -> dict:
    """Mean per-user difference a - b with a paired bootstrap CI, for every per-user figure both
    rows hold (MRR from the reciprocal ranks, Recall@K), on the users both scored; {} when a row
    has no per-user values."""
    from gti.eval.metrics import paired_bootstrap_ci

    pv = _paired_values(a, b)
    if pv is None:
        return {}
    both, vals = pv
    out: dict = {"n_users": len(both)}
    for m, (x, y) in vals.items():
        out[m] = {"value": float((x - y).mean()) if both else 0.0,
                  "ci": list(paired_bootstrap_ci(x, y, n_boot=n_boot, seed=seed))}
    return out


def overall(arms: dict, baselines: dict, share: dict, n_boot: int = 1000, seed: int = 0) -> dict:
    """What the slices mean for all test users: each figure as share * new-target value +
    (1 - share) * old-target value (share = `share["new_target_users"] / share["test_users"]`,
    the test users whose target is new), with a bootstrap CI that resamples each slice on its own
    (`gti.eval.metrics.stratified_bootstrap_ci`), for every arm and baseline with per-user values
    on both slices, and the PAIRS' differences the same way (per slice on the users both scored).
    -> {"share_new", "rows": {name: {metric: {"value", "ci"}}}, "paired": {"a-b": {...}}}."""
    import numpy as np

    from gti.eval.metrics import stratified_bootstrap_ci

    p = share["new_target_users"] / share["test_users"]
    rows = {**{a: {sl: r[sl] for sl in SLICES} for a, r in arms.items()},
            **{b: {sl: baselines[sl][b] for sl in SLICES} for b in baselines.get(SLICES[0], {})
               if all(b in baselines.get(sl, {}) for sl in SLICES)}}

    def cell(new, old) -> dict:
        v, lo, hi = stratified_bootstrap_ci([new, old], [p, 1 - p], n_boot=n_boot, seed=seed)
        return {"value": v, "ci": [lo, hi]}

    out: dict = {"share_new": p, "rows": {}, "paired": {}}
    for name, r in rows.items():
        new, old = ({("mrr" if m == "rr" else m): v for m, v in r[sl].get("per_user", {}).items() if m != "user"}
                    for sl in SLICES)
        if new and old and r[SLICES[0]]["per_user"]["user"] and r[SLICES[1]]["per_user"]["user"]:
            out["rows"][name] = {m: cell(new[m], old[m]) for m in new if m in old}
    for a, b in ((a, b) for a, b in PAIRS if a in rows and b in rows):
        pv = [_paired_values(rows[a][sl], rows[b][sl]) for sl in SLICES]
        if all(x is not None and x[0] for x in pv):
            out["paired"][f"{a}-{b}"] = {m: cell(np.subtract(*pv[0][1][m]), np.subtract(*pv[1][1][m]))
                                         for m in pv[0][1] if m in pv[1][1]}
    return out


def paired_rows(arms: dict, baselines: dict) -> dict:
    """{slice: {"a-b": paired_diff(a, b)}} for the PAIRS whose rows are both there."""
    out: dict = {}
    for sl in SLICES:
        rows = {**{a: r[sl] for a, r in arms.items()}, **baselines.get(sl, {})}
        out[sl] = {f"{a}-{b}": d for a, b in PAIRS if a in rows and b in rows
                   for d in [paired_diff(rows[a], rows[b])] if d}
    return out


def without_per_user(row: dict) -> dict:
    """A row for the printed JSON: per-user lists dropped (they stay in the records)."""
    return {k: (without_per_user(v) if isinstance(v, dict) else v) for k, v in row.items() if k != "per_user"}


def _cell(c: dict | None, digits: int = 3) -> str:
    if not c:
        return "-"
    lo, hi = c["ci"]
    return f"{c['value']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def markdown_table(out: dict) -> str:
    """The bench's JSON as markdown for bench/refresh/RESULTS.md: per slice, every arm and baseline
    (Recall@K, MRR and the new items' share of the top K with CIs, users, wall time), then the
    paired differences."""
    cols = [*(f"recall@{k}" for k in out["ks"]), "mrr", f"new_share@{max(out['ks'])}"]
    head = " | ".join("MRR" if c == "mrr" else c for c in cols)

    def cells(r: dict) -> str:
        return " | ".join(_cell(r.get(c), 4 if c == "mrr" else 3) for c in cols)

    lines = []
    for sl in SLICES:
        lines += [f"{sl} ({out['n_users'][sl]} users)", "", f"| arm | users | {head} | wall s |",
                  "|---|---|" + "---|" * (len(cols) + 1)]
        rows = {**{a: (r[sl], r.get("wall_s")) for a, r in out["arms"].items()},
                **{b: (r, None) for b, r in out["baselines"].get(sl, {}).items()}}
        for name, (r, wall) in rows.items():
            lines.append(f"| {name} | {r.get('n_users', out['n_users'][sl])} | {cells(r)} | "
                         f"{'-' if wall is None else f'{wall:.0f}'} |")
        if sl in out.get("new_item_prior", {}):  # a reference, not a servable baseline
            r = out["new_item_prior"][sl]
            lines.append(f"| (MostPop of new items only) | {out['n_users'][sl]} | {cells(r)} | - |")
        pairs = out.get("paired", {}).get(sl, {})
        if pairs:
            lines += ["", f"| paired (first - second) | users | {head} |", "|---|---|" + "---|" * len(cols)]
            lines += [f"| {p} | {d['n_users']} | {cells(d)} |" for p, d in pairs.items()]
        lines.append("")
    w = out.get("overall")
    if w and w["rows"]:
        lines += [f"all test users (weighted: {w['share_new']:.1%} have a new target; each slice resampled on its own)",
                  "", f"| arm | {head} |", "|---|" + "---|" * len(cols)]
        lines += [f"| {name} | {cells(r)} |" for name, r in w["rows"].items()]
        if w["paired"]:
            lines += ["", f"| paired (first - second) | {head} |", "|---|" + "---|" * len(cols)]
            lines += [f"| {p} | {cells(d)} |" for p, d in w["paired"].items()]
        lines.append("")
    return "\n".join(lines)


def inputs_hash(all_inter: Path, new_ids: list[str], n_users: int, seed: int) -> str:
    """sha256 of what decides the scored users: the interactions (order-free content hash,
    `gti.experiments.records.table_hash`), the new items, the users per slice and the seed.
    Recorded in slices.json and checked before any training, so a part of the bench on other
    data (another --seed, --n-new or --users) is never mixed with the recorded ones."""
    import hashlib

    from gti.experiments.records import table_hash

    key = {"interactions": table_hash(all_inter), "new": sorted(new_ids), "users": n_users, "seed": seed}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def make_slices(seq_path: Path, new_ids: list[str], catalog: list[str], n_users: int, ks: list[int],
                seed: int, inputs: str) -> dict:
    """The scored users: up to `n_users` test users whose target is a new item and as many
    whose target is an old one ({slice: {"histories", "targets"}}; history = train items + the
    valid item), with MostPop and Markov fitted on the training sequences and scored on them,
    and `inputs` (the inputs_hash they came from)."""
    import polars as pl

    from gti.data.holdout import new_target_users
    from gti.eval.slices import eval_windows

    seqs = pl.read_parquet(seq_path)
    new_u = new_target_users(seqs, new_ids).head(n_users)
    old_u = seqs.filter(~pl.col("test_item").is_in(new_ids)).sample(n=min(new_u.height, seqs.height - new_u.height),
                                                                   seed=seed)
    out: dict = {"inputs_hash": inputs, "baselines": {}}
    train_seqs = training_sequences(seqs)
    for name, df in (("new_target", new_u), ("old_target", old_u)):
        # The evaluate stage's test prompts (history = train items + the valid item), uncapped:
        # `score` cuts each history to its model's data.max_history.
        frame = eval_windows(df, "test", UNCAPPED)
        hist = frame["history"].to_list()
        out[name] = {"histories": hist, "targets": frame["target"].to_list()}
        # Reference rows on the same users, fitted on the training sequences (old and new
        # interactions, the targets held out as for the model).
        out["baselines"][name] = baseline_scores(train_seqs, catalog, hist, out[name]["targets"], ks)
    return out


def training_sequences(seqs) -> list[list[str]]:
    """Every user's training items, what the baselines learn from: the models' SFT windows saw
    no other items (the evaluate stage fits its baselines on the same for the valid split)."""
    from gti.eval.reference import split_train_sequences

    return split_train_sequences(seqs, "valid")


def new_item_prior(seq_path: Path, new_ids: list[str], slices: dict, ks: list[int]) -> dict:
    """A reference that knows which items are new: MostPop over the new items alone (fitted on
    the training sequences), on both slices ({slice: {"recall@K", "mrr"}}). Not a baseline one
    can serve (nothing tells which users' next item is new); it shows how much a model gains on
    new-target users only by moving its top K toward the new items."""
    import polars as pl

    seqs = pl.read_parquet(seq_path)
    train_seqs = training_sequences(seqs)
    return {sl: without_per_user(baseline_scores(train_seqs, list(new_ids), slices[sl]["histories"],
                                                 slices[sl]["targets"], ks)["mostpop"]) for sl in SLICES}


def test_share(seq_path: Path, new_ids: list[str]) -> dict:
    """How many of all test users have a new item as their target (the weight of the new-target
    slice in `overall`): {"new_target_users", "test_users"}."""
    import polars as pl

    from gti.data.holdout import new_target_users

    seqs = pl.read_parquet(seq_path)
    return {"new_target_users": new_target_users(seqs, new_ids).height, "test_users": seqs.height}


class Store:
    """Finished parts of a bench, one JSON file each, in `--records` (kept across sessions) or
    else `<work>/scores/`: `slices.json`, `base.json`, `<arm>.json` (wall time, steps) and
    `<arm>.<slice>.json` (its scores)."""

    def __init__(self, root: Path):
        self.root = root

    def has(self, name: str) -> bool:
        return (self.root / f"{name}.json").is_file()

    def get(self, name: str, compute):
        """The recorded `name`, else compute() recorded."""
        return cached(self.root / f"{name}.json", compute)

    def read(self, name: str) -> dict:
        return json.loads((self.root / f"{name}.json").read_text())

    def arm_done(self, arm: str) -> bool:
        return self.has(arm) and all(self.has(f"{arm}.{sl}") for sl in SLICES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, 300 items: a smoke test")
    ap.add_argument("--n-new", type=int, default=None)
    ap.add_argument("--users", type=int, default=None, help="users per slice (quick 40, full 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="work folder (default: a temp dir, removed)")
    ap.add_argument("--records", default=None,
                    help="folder of finished parts, kept across sessions (full mode: bench/refresh/smollm2)")
    ap.add_argument("--arms", default=",".join(ARMS), help="arms this part computes (the others are read "
                    "from the records when there)")
    ap.add_argument("--baseline-records", default=None,
                    help="records folder a variant shares (e.g. bench/refresh/smollm2): its users, references "
                    "and the arms not in --arms are copied into --records when missing there, so the variant's "
                    "refresh pairs with them")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        ap.error(f"unrecognized arguments: {bad}")
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        ap.error(f"--arms: {sorted(set(arms) - set(ARMS)) or arms} not among {list(ARMS)}")
    mode = QUICK if args.quick else FULL
    n_new, n_users = args.n_new or mode["n_new"], args.users or mode["users"]
    ov = [*mode["overrides"], f"seed={args.seed}", *overrides]
    own = args.work is None
    work = Path(args.work or tempfile.mkdtemp(prefix="gti-bench-refresh-")).resolve()
    records = args.records or mode["records"]
    store = Store(Path(records).resolve() if records else work / "scores")
    if args.baseline_records:
        src = Path(args.baseline_records).resolve()
        if not (src / "slices.json").is_file():
            ap.error(f"--baseline-records: {src}/slices.json not found (not a records folder)")
        log(f"from {src}: {seed_records(store, src, arms) or 'nothing (all there)'}")
    try:
        out = run_bench(args, mode, arms, n_new, n_users, ov, work, store)
        log(markdown_table(out))
        print(json.dumps(out))
        return 0
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def run_bench(args, mode: dict, arms: list[str], n_new: int, n_users: int, ov: list[str], work: Path,
              store: Store) -> dict:
    """Train what `arms` needs and the store lacks, score it, and return the bench's JSON (every
    recorded arm, not only this part's)."""
    import polars as pl

    from gti.run.loaded import load_recommender

    paths, h = write_data(work, args.quick, n_new, args.seed)
    catalog = pl.read_parquet(paths["all_items"], columns=["item_id"])["item_id"].cast(pl.Utf8).to_list()
    inputs = inputs_hash(paths["all_inter"], h.new_ids, n_users, args.seed)
    recorded = store.read("slices")["inputs_hash"] if store.has("slices") else inputs
    if recorded != inputs:
        raise SystemExit(f"{store.root}/slices.json was recorded on other inputs (inputs hash {recorded}, these "
                         f"{inputs}: another --seed, --n-new, --users or data); use another --records folder")
    for a in (a for a in ARMS if store.has(a)):
        if arm_overrides(a, store.read(a).get("overrides", ov)) != arm_overrides(a, ov):
            raise SystemExit(f"{store.root}/{a}.json was recorded with overrides {store.read(a)['overrides']}, this "
                             f"part has {ov} (for {a}: {arm_overrides(a, ov)}); use another --records folder "
                             f"for a variant")
    todo = [a for a in arms if not store.arm_done(a)]
    log(f"{h.new_items.height} new items, {h.new_interactions.height} new interactions; recorded in {store.root}: "
        f"{[a for a in ARMS if store.arm_done(a)]}; to run: {todo}")
    loaders = {}
    if {"refresh", "assign_only"} & set(todo):
        log("base run ...")
        t_base = run_pipeline(mode["config"], work / "base", paths["base_items"], paths["base_inter"], ov)
        store.get("base", lambda: {"wall_s": round(t_base, 2)})
        if "refresh" in todo:
            run_ref = linked_copy(work / "base", work / f"refresh_run{variant_suffix(ov, mode)}")
            res = refresh_once(run_ref, paths["new_items"], paths["new_inter"], ov)
            loaders["refresh"] = (lambda: load_recommender(run_ref, version=res.k),
                                  {"wall_s": round(res.facts["total_wall_s"], 2), "steps": res.facts["steps"],
                                   "wall_s_per_step": res.facts["wall_s"], "assigned": res.facts["assigned"],
                                   "sid_map_hash": res.new_hash})
        if "assign_only" in todo:
            run_asg = linked_copy(work / "base", work / f"assign_run{variant_suffix(ov, mode)}")
            res0 = refresh_once(run_asg, paths["new_items"], paths["new_inter"],
                                [*ov, "refresh.ground_steps=0", "refresh.sft_steps=0"])
            # Its export: the base model as is, or with the added tokens' rows (the base model
            # alone cannot spell a map with a grown last level, and loading it so is refused).
            loaders["assign_only"] = (lambda: load_recommender(run_asg, version=res0.k),
                                      {"wall_s": round(res0.facts["total_wall_s"], 2),
                                       "wall_s_per_step": res0.facts["wall_s"], "assigned": res0.facts["assigned"],
                                       "sid_map_hash": res0.new_hash})
    if "retrain" in todo:
        t_retrain = run_pipeline(mode["config"], work / "retrain", paths["all_items"], paths["all_inter"], ov)
        loaders["retrain"] = (lambda: load_recommender(work / "retrain"), {"wall_s": round(t_retrain, 2)})

    def full_sequences() -> Path:
        # The scored users come from the full data's ingest (the retrain run's first stage), in
        # whichever order the parts run: a refresh's merged sequences lack users whose base
        # history was too short to keep, and many new-target users are such users.
        run_pipeline(mode["config"], work / "retrain", paths["all_items"], paths["all_inter"], ov, to_stage="ingest")
        return work / "retrain" / "ingest" / "sequences.parquet"

    slices = store.get("slices", lambda: make_slices(full_sequences(), h.new_ids, catalog, n_users, mode["ks"],
                                                     args.seed, inputs))
    prior = store.get("new_item_prior", lambda: new_item_prior(full_sequences(), h.new_ids, slices, mode["ks"]))
    share = store.get("test_share", lambda: test_share(full_sequences(), h.new_ids))
    for arm, (load, meta) in loaders.items():
        missing = [sl for sl in SLICES if not store.has(f"{arm}.{sl}")]
        rec = load() if missing else None  # a model is loaded only when some slice is unscored
        for sl in missing:
            store.get(f"{arm}.{sl}", lambda sl=sl: score(rec, slices[sl]["histories"], slices[sl]["targets"],
                                                          mode["ks"], new_ids=frozenset(h.new_ids)))
        store.get(arm, lambda meta=meta: {**meta, "overrides": ov})
        log(f"{arm}: {json.dumps({sl: without_per_user(store.read(f'{arm}.{sl}')) for sl in SLICES})}")
    done = [a for a in ARMS if store.arm_done(a)]
    res_arms = {a: {**store.read(a), **{sl: store.read(f"{a}.{sl}") for sl in SLICES}} for a in done}
    hashes = {res_arms[a]["sid_map_hash"] for a in ("refresh", "assign_only") if a in res_arms}
    assert len(hashes) <= 1, f"refresh and assign_only assigned different SIDs: {hashes}"  # only training differs
    base = store.read("base") if store.has("base") else {}
    paired = paired_rows(res_arms, slices["baselines"])
    weighted = overall(res_arms, slices["baselines"], share)
    res_arms = {a: without_per_user(r) for a, r in res_arms.items()}
    return {"bench": "refresh", "mode": "quick" if args.quick else "full", "config": str(mode["config"].name),
            "ks": mode["ks"], "n_new_items": len(h.new_ids), "assigned": next((r["assigned"] for r in res_arms.values() if "assigned" in r),
                                                             None),
            "n_users": {sl: len(slices[sl]["targets"]) for sl in SLICES}, "base_train_wall_s": base.get("wall_s"),
            "overrides": ov, "arms": res_arms, "missing_arms": [a for a in ARMS if a not in done],
            "baselines": without_per_user(slices["baselines"]), "new_item_prior": prior, "paired": paired,
            "test_share": share, "overall": weighted,
            "records": str(store.root)}


if __name__ == "__main__":
    raise SystemExit(main())
