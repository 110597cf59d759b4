"""`gti refresh` (gti/refresh/, the command in gti/refresh/command.py) and versioned SID maps in use
(gti/run/versions.py, evaluate, recommend), on a tiny run: 300 items of the bundled data, 12 of them held out as "new"
(`gti.data.holdout`), the tiny pipeline run on the rest through sft with 0 training steps (no
refresh assertion depends on a trained parent: the refresh's own grounding and SFT train).

- v1 = 6 new items (+ bad rows) and their interactions (+ bad rows), 6 grounding steps: old
  SIDs unchanged, new SIDs unique, parent hash, quarantine, the model's meta, the lineage;
  made the way a killed refresh is finished: the first call's grounding dies before its first
  step, the rerun keeps the finished steps and hands the shared loop the same run (storage
  path, name, config, rows), which is what makes the loop resume it (tests/train/test_loop.py);
- v2 = the other 6 items with 2 SFT steps (no grounding): chained versions, recommend's default;
- evaluation's and recommend's check: a descendant map accepted, an unrelated one refused
  naming both hashes;
- a full prefix group: one error line, exit 2; with `refresh.on_full_group=add_tokens` the last
  level grows instead, the added tokens reach the refreshed model (grounded with the others),
  `gti recommend --version 1` loads it and the run's model refuses the grown map.

The fast tests at the end use the fake run of conftest.py (no model, no Ray): the step record
that makes a rerun skip finished steps, the work folder's fingerprint, the export of an
untrained refresh, and the argument checks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
import torch
from testkit import FailOnceFit, WorkerDied

from gti import config as C
from gti.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "jobs" / "configs"
N_ITEMS, N_NEW = 300, 12
REFRESH = ["refresh.ground_steps=6", "refresh.replay_ratio=1.0", "ground.batch_size=4"]


def _bundled():
    from gti.data import bundled

    items = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "items")).head(N_ITEMS)
    inter = pl.read_parquet(bundled.resolve("bundled:amazon-scientific", "interactions"))
    return items, inter.filter(pl.col("item_id").is_in(items["item_id"].implode()))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from gti.data.holdout import holdout_new_items

    d = tmp_path_factory.mktemp("refresh_data")
    items, inter = _bundled()
    h = holdout_new_items(items, inter, N_NEW, seed=3)
    h.base_items.write_parquet(d / "base_items.parquet")
    h.base_interactions.write_parquet(d / "base_inter.parquet")
    half = [set(h.new_ids[: N_NEW // 2]), set(h.new_ids[N_NEW // 2:])]
    for i, ids in enumerate(half, 1):
        new_items = h.new_items.filter(pl.col("item_id").is_in(list(ids)))
        new_inter = h.new_interactions.filter(pl.col("item_id").is_in(list(ids)))
        if i == 1:  # bad rows: no id, a duplicate id, no text; an unknown item, a missing user
            bad = pl.DataFrame({"item_id": [None, new_items["item_id"][0], "zz-notext"],
                                "title": ["No id", "Duplicate", None], "description": [None, None, None]},
                               schema={"item_id": pl.Utf8, "title": pl.Utf8, "description": pl.Utf8})
            new_items = pl.concat([new_items, bad], how="diagonal_relaxed")
            new_inter = pl.concat([new_inter, pl.DataFrame(
                {"user_id": ["0", None], "item_id": ["no-such-item", new_items["item_id"][0]], "ts": [10**9, 10**9]},
                schema={"user_id": pl.Utf8, "item_id": pl.Utf8, "ts": pl.Int64})], how="diagonal_relaxed")
        new_items.write_parquet(d / f"new{i}_items.parquet")
        new_inter.write_parquet(d / f"new{i}_inter.parquet")
    return d, h, half


@pytest.fixture(scope="module")
def base_run(data, tmp_path_factory, ray_start_4_cpus):
    from gti.run import pipeline

    d, _, _ = data
    run = tmp_path_factory.mktemp("refresh_base") / "run"
    cfg = C.load(CONFIGS / "tiny.yaml", [
        f"run_dir={run}", f"data.items.path={d / 'base_items.parquet'}",
        f"data.interactions.path={d / 'base_inter.parquet'}", "data.max_items=null",
        "ground.steps=0", "sft.steps=0",  # untrained: the refresh trains, its parent need not
    ])
    pipeline.run(cfg, to_stage="sft", echo=lambda m: None)
    return run


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest, symlinks=True)
    # config.yaml of each stage names run_dir; refresh uses the folder it is given.
    return dest


@pytest.fixture(scope="module")
def refreshed(base_run, data, tmp_path_factory):
    """v1 on a copy of the base run. The first call's grounding dies before its first step
    (`FailOnceFit`); the same call again finishes it. Returns (run, result); the recorded fit
    and the work folder's state after the failure are in `killed_refresh` below."""
    import gti.train.loop as loop
    from gti.refresh.command import refresh

    d, _, _ = data
    run = _copy(base_run, tmp_path_factory.mktemp("refresh_a") / "run")
    fit = FailOnceFit(loop.fit)
    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "fit", fit)
    try:
        with pytest.raises(WorkerDied):
            refresh(run, d / "new1_items.parquet", d / "new1_inter.parquet", REFRESH, log=lambda m: None)
        partial = run / "refresh" / ".v1.partial"
        _KILLED.update(fit=fit, steps=json.loads((partial / "_steps.json").read_text()),
                       v1_after_failure=(run / "refresh" / "v1").exists())
        res = refresh(run, d / "new1_items.parquet", d / "new1_inter.parquet", REFRESH, log=lambda m: None)
    finally:
        mp.undo()
    return run, res


_KILLED: dict = {}


def _map(path) -> dict[str, str]:
    t = pq.read_table(str(path))
    return dict(zip(t.column("item_id").to_pylist(), t.column("sid").to_pylist()))


@pytest.mark.slow
@pytest.mark.ray
def test_refresh_keeps_old_sids_gives_unique_new_ones_and_records_the_version(refreshed, data):
    from gti.lm.new_rows import read_meta
    from gti.run.manifest import Manifest
    from gti.run import versions as run_versions
    from gti.sid.versions import read_version

    run, res = refreshed
    _, _, half = data
    base = _map(run / "sid" / "sid_map.parquet")
    new = _map(res.map_path)
    assert all(new[i] == s for i, s in base.items())  # every old SID unchanged
    assert len(set(new.values())) == len(new)  # every SID unique
    added = set(new) - set(base)
    assert added == half[0] and res.facts["assigned"] == len(half[0]) == 6
    base_hash = Manifest.read(run / "sid").fact("sid_map_hash")
    v = read_version(res.map_path)
    assert v.parent_hash == base_hash == res.parent_hash and v.hash == res.new_hash != base_hash
    assert v.n_items == len(new) and res.facts["full_groups"] == 0
    # The lineage holds the base map and the new one; the model records what it was trained with.
    lin = run_versions.lineage_dir(run)
    assert lin.get(base_hash).parent_hash is None and lin.get(v.hash).parent_hash == base_hash
    meta = read_meta(res.model_dir)
    assert meta["sid_map_hash"] == v.hash and meta["sid_map_parent"] == base_hash
    assert meta["sid_map_version"]["hash"] == v.hash
    m = Manifest.read(res.dir)
    assert m.facts["parent_hash"] == base_hash and m.facts["new_hash"] == v.hash
    assert m.facts["steps"] == {"ground": 6, "sft": 0}
    assert set(m.facts["wall_s"]) == {"ingest", "embed", "assign", "tokens", "pairs", "ground", "sft", "export"}
    assert m.facts["added_tokens"] == [] and m.facts["codebook_sizes"] == list(v.codebook_sizes)
    assert run_versions.resolve(run).refreshes[-1].dir == res.dir
    # Only the SID rows moved: every other row of the model is the parent's.
    from safetensors.torch import load_file

    old = load_file(str(run / "sft" / "model" / "model.safetensors"))
    got = load_file(str(res.model_dir / "model.safetensors"))
    first, end = Manifest.read(run / "pairs").fact("new_token_ids")
    name = next(k for k in got if k.endswith("embed_tokens.weight"))
    assert torch.equal(got[name][:first], old[name][:first])
    assert not torch.equal(got[name][first:end], old[name][first:end])
    for k in got:
        if k != name and "lm_head" not in k:
            assert torch.equal(got[k], old[k]), k


@pytest.mark.slow
@pytest.mark.ray
def test_bad_new_rows_are_quarantined_with_reasons(refreshed, data):
    run, res = refreshed
    d, _, _ = data
    q = pl.read_parquet(res.dir / "ingest" / "items_quarantine.parquet")
    assert sorted(q["reason"].to_list()) == ["duplicate_id", "missing_id", "no_text"]
    assert set(q["source_file"].to_list()) == {str(d / "new1_items.parquet")}
    assert q["source_row"].to_list() == sorted(q["source_row"].to_list())
    iq = pl.read_parquet(res.dir / "ingest" / "interactions_quarantine.parquet")
    assert {"unknown_item", "missing_user"} <= set(iq["reason"].to_list())
    f = res.facts["ingest"]
    assert f["items_rows_in"] == f["items_rows_ok"] + f["items_rows_quarantined"] == 9
    assert f["interactions_rows_in"] == f["interactions_rows_ok"] + f["interactions_rows_quarantined"]


@pytest.mark.slow
@pytest.mark.ray
def test_killed_refresh_keeps_finished_steps_and_hands_the_loop_the_same_run(refreshed):
    """The refresh whose grounding died: no v1 published, every step before grounding recorded
    as finished (a rerun skips them), and the rerun called the loop with the same storage path,
    run name, loop config and rows, then published v1 with 6 grounding steps."""
    run, res = refreshed
    assert _KILLED["v1_after_failure"] is False
    assert set(_KILLED["steps"]) == {"ingest", "embed", "assign", "tokens", "pairs"}
    _KILLED["fit"].assert_same_run()
    assert str(run / "refresh" / ".v1.partial") in _KILLED["fit"].calls[0]["storage_path"]
    assert res.k == 1 and res.facts["steps"]["ground"] == 6


@pytest.mark.slow
@pytest.mark.ray
def test_descendant_map_accepted_unrelated_refused_in_recommend_and_evaluate(refreshed, tmp_path):
    import pyarrow as pa

    from gti.run.loaded import load_recommender
    from gti.run.manifest import Manifest
    from gti.run import versions as run_versions
    from gti.sid.versions import UnrelatedSidMapError, make_version, read_version, write_map
    from gti.stages.evaluate import Recommender as EvalActor

    run, res = refreshed
    old_model = run / "sft" / "model"
    v = read_version(res.map_path)
    # recommend: the newest version by default (a new item has a SID and can come back) ...
    rec = load_recommender(run)
    assert rec.model_stage == "refresh/v1" and rec.model_dir == res.model_dir
    new_ids = json.loads((res.dir / "sid" / "new_items.json").read_text())["assigned"]
    assert set(new_ids) <= set(rec.item_ids) and all(rec.titles.get(i) for i in new_ids)
    out = rec.recommend([new_ids[0], new_ids[1]], k=len(rec.item_ids))
    assert {r["item_id"] for r in out} >= set(new_ids)  # the whole catalog ranked, new items in it
    # ... the old model with the new map (descends from the map it was trained with) ...
    assert run_versions.check_model_map(old_model, v.hash, map_path=res.map_path) == 1
    assert load_recommender(run, model_dir=old_model).model_dir == old_model.resolve()
    assert load_recommender(run, version=0).model_stage == "sft"
    # ... evaluation's actor the same way.
    sid_facts = dict(Manifest.read(run / "sid").facts, sid_map_hash=v.hash)
    cfg = C.load(run / "sft" / "config.yaml").model_dump(mode="json")
    EvalActor(str(old_model), str(res.map_path), sid_facts, cfg)
    # An "unrelated" map: claims the base map as parent but moves an old item's SID.
    t = pq.read_table(str(res.map_path)).to_pydict()
    j = next(i for i, it in enumerate(t["item_id"]) if it not in new_ids)
    k = next(i for i in range(len(t["sid"])) if t["item_id"][i] not in new_ids and t["sid"][i] != t["sid"][j])
    t["codes"][j], t["codes"][k] = t["codes"][k], t["codes"][j]
    t["sid"][j], t["sid"][k] = t["sid"][k], t["sid"][j]
    bad = pa.table(t, schema=pq.read_schema(str(res.map_path)))
    bad_dir = run / "refresh" / "vbad" / "sid"
    bad_dir.mkdir(parents=True)
    bv = make_version(bad, v.codebooks_hash, v.codebook_sizes, v.token_format, v.parent_hash)
    write_map(bad_dir / "sid_map.parquet", bad, bv)
    base_hash = Manifest.read(run / "sid").fact("sid_map_hash")
    with pytest.raises(UnrelatedSidMapError, match=f"{bv.hash} does not descend from {base_hash}.*changed SID"):
        run_versions.check_model_map(old_model, bv.hash, map_path=bad_dir / "sid_map.parquet")
    with pytest.raises(UnrelatedSidMapError, match=f"{bv.hash} does not descend from {base_hash}"):
        EvalActor(str(old_model), str(bad_dir / "sid_map.parquet"), dict(sid_facts, sid_map_hash=bv.hash), cfg)
    # A map with no record at all: the old wording, both hashes named.
    plain = tmp_path / "plain.parquet"
    pq.write_table(bad, str(plain))
    with pytest.raises(UnrelatedSidMapError, match=f"{base_hash} but the SID map's sid_map_hash is {bv.hash}: stale"):
        run_versions.check_model_map(old_model, bv.hash, map_path=plain)
    # The refreshed model refuses the base map: it descends the other way.
    with pytest.raises(UnrelatedSidMapError, match=f"{base_hash} does not descend from {v.hash}"):
        run_versions.check_model_map(res.model_dir, base_hash, map_path=run / "sid" / "sid_map.parquet")
    shutil.rmtree(run / "refresh" / "vbad")


@pytest.mark.slow
@pytest.mark.ray
def test_second_refresh_chains_versions_and_runs_sft(refreshed, data):
    from gti.run.loaded import load_recommender
    from gti.refresh.command import refresh
    from gti.run import versions as run_versions
    from gti.sid.versions import read_version

    run, res1 = refreshed
    d, _, half = data
    # SIDs + a refresh SFT only (v1 and the add_tokens test prove a refresh's grounding): one
    # Train run instead of two.
    res2 = refresh(run, d / "new2_items.parquet", d / "new2_inter.parquet",
                   ["refresh.ground_steps=0", "refresh.sft_steps=2", "sft.batch_size=4",
                    "sft.checkpoint_every=2"], log=lambda m: None)
    assert res2.k == 2 and res2.parent_hash == res1.new_hash
    m1, m2 = _map(res1.map_path), _map(res2.map_path)
    assert all(m2[i] == s for i, s in m1.items()) and set(m2) - set(m1) == half[1]
    assert len(set(m2.values())) == len(m2)
    assert res2.facts["steps"] == {"ground": 0, "sft": 2} and res2.facts["sft"]["windows"] > 0
    assert run_versions.check_model_map(run / "sft" / "model", res2.new_hash, map_path=res2.map_path) == 2
    assert read_version(res2.map_path).parent_hash == res1.new_hash
    assert load_recommender(run).model_stage == "refresh/v2"
    seqs = pl.read_parquet(res2.dir / "ingest" / "sequences.parquet")
    assert seqs["test_item"].is_in(list(half[0] | half[1])).any()


@pytest.mark.slow
@pytest.mark.ray
def test_full_prefix_group_fails_with_one_line(base_run, data, tmp_path, capsys):
    """More copies of one item than the de-duplication level holds: one line, exit 2, the list
    written. Needs no training (the refresh stops at the assign step)."""
    from gti.cli import main
    from gti.run.manifest import Manifest

    run = _copy(base_run, tmp_path / "run")
    row = pl.read_parquet(data[0] / "base_items.parquet").head(1)
    extra = int(Manifest.read(run / "sid").fact("codebook_sizes")[-1])
    copies = pl.concat([row.with_columns(pl.lit(f"copy{i}").alias("item_id")) for i in range(extra + 1)])
    copies.write_parquet(tmp_path / "copies.parquet")
    rc = main(["refresh", "--run-dir", str(run), "--items", str(tmp_path / "copies.parquet"),
               "refresh.ground_steps=0", "refresh.on_full_group=error"])  # the opt-in stop
    err = capsys.readouterr().err.strip().splitlines()
    # Progress lines ([refresh] ...) come first; the error is one line, the last.
    errors = [ln for ln in err if ln.startswith("gti: error:")]
    assert rc == 2 and errors == [err[-1]], err
    assert err[-1].startswith("gti: error: refresh: ") and "need a SID token the vocabulary lacks" in err[-1]
    assert "refresh.on_full_group=error" in err[-1] and "Traceback" not in "\n".join(err)
    listed = json.loads((run / "refresh" / ".v1.partial" / "needs_new_tokens.json").read_text())
    assert len(listed) >= 1 and all(x["item_id"].startswith("copy") for x in listed)
    assert not (run / "refresh" / "v1").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_a_full_prefix_group_is_served_by_default(base_run, data, tmp_path, capsys):
    """A product line: 12 near-identical new items (one item's text, each title with its own
    size) on the small map, refreshed with the DEFAULTS but 8 grounding steps (issue 51 item
    10: `refresh.on_full_group` is `add_tokens` by default, chosen on bench/refresh/full_group.py):
    the group overflows and the last level grows instead of the refresh stopping; every item gets
    a unique SID (old ones unchanged), the version records the grown size, the model has the
    added tokens (rows trained from their level's mean), `gti recommend --version 1` loads it, a
    serving replica's poll swaps it in and knows every new item, and the run's own model
    refuses the grown map naming the tokens."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from gti.cli import main
    from gti.lm.new_rows import read_meta
    from gti.run.manifest import Manifest
    from gti.refresh.command import refresh
    from gti.run.loaded import load_recommender
    from gti.sid.versions import MissingSidTokensError, read_version

    run = _copy(base_run, tmp_path / "run")
    sizes = [int(k) for k in Manifest.read(run / "sid").fact("codebook_sizes")]
    row = pl.read_parquet(data[0] / "base_items.parquet").head(1)
    n_new = max(12, sizes[-1] + 1)  # more than the de-duplication level holds
    copies = pl.concat([row.with_columns(pl.lit(f"copy{i}").alias("item_id"),
                                         (pl.col("title") + f" ({50 * (i + 1)} ml)").alias("title"))
                        for i in range(n_new)])
    copies.write_parquet(tmp_path / "copies.parquet")
    assert C.load(None, []).refresh.on_full_group == "add_tokens"
    res = refresh(run, tmp_path / "copies.parquet", None,
                  ["refresh.ground_steps=8", "refresh.replay_ratio=0", "ground.batch_size=4"], log=lambda m: None)
    base, new = _map(run / "sid" / "sid_map.parquet"), _map(res.map_path)
    assert all(new[i] == s for i, s in base.items()) and len(set(new.values())) == len(new)
    assert set(new) - set(base) == set(copies["item_id"]) and res.facts["assigned"] == copies.height
    listed = json.loads((res.dir / "needs_new_tokens.json").read_text())
    n_listed = len(listed)  # near-identical: one group (or a few), grown by what the fullest lacked
    v = read_version(res.map_path)
    n_add = v.codebook_sizes[-1] - sizes[-1]
    assert n_listed >= 1 and 1 <= n_add <= n_listed and list(v.codebook_sizes[:-1]) == sizes[:-1]
    assert res.facts["codebook_sizes"] == list(v.codebook_sizes) and res.facts["full_groups"] == n_listed
    added = res.facts["added_tokens"]
    assert len(added) == n_add and res.facts["steps"]["ground"] == 8
    # the tokenizer and the embedding have the added tokens, after the parent's
    parent = run / "sft" / "model"
    ptok, tok = AutoTokenizer.from_pretrained(str(parent)), AutoTokenizer.from_pretrained(str(res.model_dir))
    end0 = len(ptok)
    assert tok.convert_tokens_to_ids(added) == list(range(end0, end0 + n_add)) and len(tok) == end0 + n_add
    first = int(Manifest.read(run / "pairs").fact("new_token_ids")[0])
    meta = read_meta(res.model_dir)
    assert meta["codebook_sizes"] == list(v.codebook_sizes) and meta["new_token_ids"] == [first, end0 + n_add]
    old_w, got_w = (load_file(str(p / "model.safetensors")) for p in (parent, res.model_dir))
    name = next(k for k in got_w if k.endswith("embed_tokens.weight"))
    assert got_w[name].shape[0] >= end0 + n_add and torch.equal(got_w[name][:first], old_w[name][:first])
    level = ptok.convert_tokens_to_ids([t for t in ptok.get_vocab() if t.startswith(added[0][:3])])
    mean = old_w[name][level].float().mean(0)
    # they started at their level's mean (gti.refresh.tokens) and were grounded with the other SID rows
    assert any(not torch.equal(got_w[name][end0 + j].float(), mean) for j in range(n_add))
    # gti recommend --version 1 loads the grown codec and trie
    rec = load_recommender(run, version=1)
    assert rec.model_dir == res.model_dir and set(copies["item_id"]) <= set(rec.item_ids)
    on_new = json.loads((res.dir / "sid" / "new_items.json").read_text())["on_new_codes"]
    sid_ids = dict(zip(rec.item_ids, rec.sid_matrix.tolist()))
    assert len(on_new) == n_listed and all(end0 <= sid_ids[i][-1] < end0 + n_add for i in on_new)
    # A serving replica started on the run's own stages swaps v1 in at its poll and serves them.
    from gti.serve.reload import ServiceHolder
    from gti.serve.service import RecommenderService

    holder = ServiceHolder(lambda k: RecommenderService.load(run, k), run)
    assert holder.load_initial(0).version == 0
    holder._board.pin(0, 0)  # as if v1 were published after the start (pinned while 0 was the newest)
    assert holder.poll() is True
    holder._thread.join(120)
    assert holder.status()["state"] == "swapped" and holder.current.version == 1, holder.status()
    ans = holder.current.recommend([["copy0", "copy1"]], 3)[0]
    assert ans["unknown_items"] == [] and set(copies["item_id"]) <= set(holder.current.run.item_ids)
    capsys.readouterr()
    assert main(["recommend", "--run-dir", str(run), "--version", "1", "--history", "copy0", "--k", "3"]) == 0
    assert "refresh/v1" in capsys.readouterr().out
    # the run's own model lacks the added tokens: refused with one line naming them and both hashes
    with pytest.raises(MissingSidTokensError) as e:
        load_recommender(run, version=1, model_dir=parent)
    msg = str(e.value)
    assert added[0] in msg and v.hash in msg and Manifest.read(run / "sid").fact("sid_map_hash") in msg
    assert "\n" not in msg


def test_refresh_config_keys_are_validated():
    with pytest.raises(ConfigError, match="refresh.on_full_group"):
        C.load(None, ["refresh.on_full_group=grow"])
    assert C.load(None, ["refresh.on_full_group=add_tokens"]).refresh.on_full_group == "add_tokens"
    assert C.load(None, []).refresh.on_full_group == "add_tokens"
    with pytest.raises(ConfigError, match="unknown key 'refresh.nope'"):
        C.load(None, ["refresh.nope=1"])
    with pytest.raises(ConfigError, match="refresh.replay_ratio"):
        C.load(None, ["refresh.replay_ratio=-1"])
    assert C.load(None, ["refresh.sft_steps=3"]).refresh.sft_steps == 3
    # the refresh's grounding lr: a tenth of ground.lr unless set (it starts from trained rows)
    cfg = C.load(None, ["ground.lr=2e-3"])
    assert cfg.refresh.ground_lr is None and cfg.refresh.ground_lr_from(cfg.ground.lr) == pytest.approx(2e-4)
    assert C.load(None, ["refresh.ground_lr=5e-3"]).refresh.ground_lr_from(1e-3) == 5e-3
    assert C.load(None, ["refresh.sft_replay_ratio=2"]).refresh.sft_replay_ratio == 2.0
    with pytest.raises(ConfigError, match="refresh.sft_replay_ratio"):
        C.load(None, ["refresh.sft_replay_ratio=-1"])


def test_holdout_picks_items_that_end_a_history():
    from gti.data.holdout import holdout_new_items, new_target_users

    items, inter = _bundled()
    h = holdout_new_items(items, inter, 5, seed=1)
    assert len(h.new_ids) == 5 and set(h.new_items["item_id"]) == set(h.new_ids)
    assert not h.base_interactions["item_id"].is_in(h.new_ids).any()
    assert h.base_interactions.height + h.new_interactions.height == inter.height
    last = inter.with_row_index("o").sort(["ts", "o"]).group_by("user_id").agg(pl.col("item_id").last())
    assert last["item_id"].is_in(h.new_ids).sum() >= 5
    seqs = pl.DataFrame({"user_id": ["a", "b"], "train_items": [["x"], ["y"]], "valid_item": ["x", "y"],
                         "test_item": [h.new_ids[0], "zz"]})
    assert new_target_users(seqs, h.new_ids)["user_id"].to_list() == ["a"]
    assert np.all(h.base_items["item_id"].is_in(h.new_ids).to_numpy() == False)  # noqa: E712


# --------------------------------------------------------------------------- fast (fake run)
def test_steps_are_recorded_and_reused_by_a_rerun(tmp_path):
    from gti.refresh.command import Steps

    logs, calls = [], []
    s = Steps(tmp_path, logs.append)
    assert s.run("ingest", lambda: calls.append(1) or {"n": 1}) == {"n": 1}
    again = Steps(tmp_path, logs.append)  # a new attempt on the same work folder
    assert again.run("ingest", lambda: calls.append(2) or {"n": 2}) == {"n": 1} and calls == [1]
    assert logs == ["ingest: done by an interrupted attempt, reused"]
    assert set(again.walls()) == {"ingest"} and again.walls()["ingest"] >= 0


def test_work_folder_is_kept_only_for_the_same_inputs_and_settings(fake_run, tmp_path):
    from gti.refresh.command import fingerprint, open_work
    from gti.refresh.attempt import find_parent

    items = tmp_path / "items.csv"
    items.write_text("item_id,title\nn1,A\n")
    parent = find_parent(fake_run.dir)
    fp = fingerprint(fake_run.cfg(items), parent, str(items), None)
    assert fp == fingerprint(fake_run.cfg(items), parent, str(items), None)
    assert fp != fingerprint(fake_run.cfg(items, None, "refresh.ground_steps=3"), parent, str(items), None)
    # the dtype the parent model is loaded in changes what the tokens and ground steps make
    assert fp != fingerprint(fake_run.cfg(items, None, "model.dtype=bfloat16"), parent, str(items), None)
    work = tmp_path / ".v1.partial"
    open_work(work, fp)
    (work / "kept").write_text("x")
    open_work(work, fp)
    assert (work / "kept").exists()
    items.write_text("item_id,title\nn1,B\n")  # the same path, other content
    fp2 = fingerprint(fake_run.cfg(items), parent, str(items), None)
    assert fp2 != fp
    open_work(work, fp2)
    assert not (work / "kept").exists() and (work / "_fingerprint").read_text() == fp2


def test_work_folder_begun_by_older_step_code_is_not_resumed(fake_run, tmp_path, monkeypatch):
    """A refresh interrupted under code that split new rows another way (WORK_FORMAT 1: leave-one-out
    on a global_time run) must not hand its finished ingest step to today's code."""
    import gti.refresh.command as cmd
    from gti.refresh.attempt import find_parent

    items = tmp_path / "items.csv"
    items.write_text("item_id,title\nn1,A\n")
    parent = find_parent(fake_run.dir)
    monkeypatch.setattr(cmd, "WORK_FORMAT", 1)
    old = cmd.fingerprint(fake_run.cfg(items), parent, str(items), None)
    work = tmp_path / ".v1.partial"
    cmd.open_work(work, old)
    cmd.Steps(work, lambda m: None).run("ingest", lambda: {"split": "leave_one_out"})
    monkeypatch.undo()
    new = cmd.fingerprint(fake_run.cfg(items), parent, str(items), None)
    assert new != old
    cmd.open_work(work, new)
    calls = []
    assert cmd.Steps(work, lambda m: None).run("ingest", lambda: calls.append(1) or {"split": "x"}) == {"split": "x"}
    assert calls == [1]


def test_export_without_training_copies_the_parents_model_with_the_new_map(make_job):
    import pyarrow.parquet as pq

    from gti.refresh.command import export_step
    from gti.sid.versions import make_version, write_map

    job = make_job()
    (job.work / "sid").mkdir()
    t = pq.read_table(str(job.parent.map_path))
    v = make_version(t.slice(0, 4), "cbhash", [4, 4, 2], parent=job.parent.hash)
    write_map(job.work / "sid" / "sid_map.parquet", t.slice(0, 4), v)
    (job.work / "val_source.parquet").write_bytes(b"")
    assert export_step(job) == {"model_source": "parent"}
    meta = json.loads((job.work / "model" / "gti_meta.json").read_text())
    assert meta["sid_map_hash"] == v.hash and meta["sid_map_parent"] == job.parent.hash
    assert meta["sid_map_version"]["hash"] == v.hash and meta["refresh_version"] == 1
    assert meta["refresh_model_source"] == "parent" and meta["refreshed_from"] == str(job.parent.model_dir)
    assert not (job.work / "val_source.parquet").exists()
    assert json.loads((job.parent.model_dir / "gti_meta.json").read_text()) == {"sid_map_hash": job.parent.hash}
    assert export_step(job) == {"model_source": "parent"}  # a rerun after an interrupted export
    (job.work / "ground_model").mkdir()
    (job.work / "ground_model" / "config.json").write_text("{}")
    assert export_step(job) == {"model_source": "ground"} and not (job.work / "ground_model").exists()
    # An export killed after moving the SFT model into place, the grounded one still beside it:
    # the rerun keeps the SFT model.
    shutil.rmtree(job.work / "model")
    for name, source in (("sft_model", "sft"), ("ground_model", "ground")):
        (job.work / name).mkdir()
        (job.work / name / "config.json").write_text(json.dumps({"source": source}))
    (job.work / "sft_model" / ".refresh_source").write_text("sft")
    (job.work / "sft_model").rename(job.work / "model")
    assert export_step(job) == {"model_source": "sft"}
    assert json.loads((job.work / "model" / "config.json").read_text()) == {"source": "sft"}


def test_refresh_refuses_bad_arguments_with_one_line(fake_run, tmp_path):
    from gti.refresh.attempt import RefreshError
    from gti.refresh.command import refresh

    with pytest.raises(RefreshError, match="run directory not found"):
        refresh(tmp_path / "nope", "items.csv")
    with pytest.raises(ConfigError, match="refresh.sft_steps > 0 needs --interactions"):
        refresh(fake_run.dir, "items.csv", None, ["refresh.sft_steps=2"])
    shutil.rmtree(fake_run.dir / "sid")
    with pytest.raises(RefreshError, match="stage 'sid' has not completed"):
        refresh(fake_run.dir, "items.csv")


def test_a_published_version_is_never_replaced(make_job):
    """`_publish` refuses a `v<k>` that has a manifest (a version another refresh published)
    before touching the lineage, and keeps the work folder."""
    from gti.refresh.command import _publish
    from gti.refresh.attempt import RefreshError

    job = make_job()
    published = job.work.parent / "v1"
    published.mkdir(parents=True)
    (published / "_manifest.json").write_text('{"stage": "refresh"}')

    class Lineage:
        def add(self, *a):
            raise AssertionError("the lineage was touched")

    with pytest.raises(RefreshError, match="already a published version"):
        _publish(job, Lineage(), None)
    assert job.work.is_dir() and (published / "_manifest.json").read_text() == '{"stage": "refresh"}'


def _fake_steps(n_items: int):
    """`run_steps` stand-in: a new map of the parent's first `n_items` items (its version record
    naming the parent) and the facts the driver reads; no model, no Ray."""
    from gti.sid.versions import make_version, write_map

    def run_steps(steps, job, fault_injection=None):
        (job.work / "sid").mkdir(parents=True, exist_ok=True)
        t = pq.read_table(str(job.parent.map_path)).slice(0, n_items)
        write_map(job.work / "sid" / "sid_map.parquet", t,
                  make_version(t, job.cb_hash, list(job.parent.codebook_sizes), parent=job.parent.hash))
        return {"assign": {"assigned": [], "already_present": [], "prefix_changed": [], "needs_new_tokens": []},
                "ground": {}, "sft": {}}

    return run_steps


def test_refresh_after_a_retrain_starts_from_the_new_base(fake_run, tmp_path, monkeypatch):
    """Each version records its base; after the run retrains, the next refresh skips v1 with one
    line, builds on the run itself and is numbered v2; recommend's default then takes v2 and
    refuses v1 by name."""
    from gti.run.manifest import Manifest
    from gti.refresh import command
    from gti.run.versions import RunDirError, base_record, chosen_version

    items = tmp_path / "items.csv"
    items.write_text("item_id,title\nn1,A\n")
    run, logs = fake_run.dir, []
    monkeypatch.setattr(command, "run_steps", _fake_steps(4))
    r1 = command.refresh(run, items, log=logs.append)
    assert r1.k == 1 and r1.facts["base"] == base_record(run)
    assert Manifest.read(r1.dir).facts["base"] == base_record(run)

    Manifest(stage="sft", fingerprint="retrained", config={}, outputs={"model": "model"}).write(run / "sft")
    monkeypatch.setattr(command, "run_steps", _fake_steps(3))
    logs.clear()
    r2 = command.refresh(run, items, log=logs.append)
    assert r2.k == 2 and r2.facts["parent_version"] == 0 and r2.parent_hash == fake_run.map_hash
    assert r2.facts["base"]["model_fingerprint"] == "retrained"
    assert sum("v1 is skipped: it was refreshed from another base" in m for m in logs) == 1
    assert (run / "refresh" / "v1" / "_manifest.json").is_file()  # never replaced

    notes: list[str] = []
    assert chosen_version(run, None, note=notes.append).k == 2 and len(notes) == 1
    with pytest.raises(RunDirError, match=r"v1 cannot be used: it was refreshed from another base"):
        chosen_version(run, 1)


def test_new_items_at_a_uri_are_fingerprinted_like_ingest(tmp_path):
    """`gti refresh --items <URI>`: the work folder's fingerprint stats the URI through its file
    system (size, mtime) instead of needing a local path; a change of the file changes it."""
    import fsspec

    from gti.refresh.command import _files_fingerprint

    fs = fsspec.filesystem("memory")
    uri = "memory://gti-refresh-test/new/items.csv"
    fs.pipe(uri, b"item_id,title\nn1,A\n")
    try:
        opts = {"skip_instance_cache": "false"}  # any option: fsspec's file system, as for a private bucket
        fp = _files_fingerprint(uri, "items", opts)
        assert fp == _files_fingerprint(uri, "items", opts)
        fs.pipe(uri, b"item_id,title\nn1,A\nn2,B\n")
        assert _files_fingerprint(uri, "items", opts) != fp
        assert _files_fingerprint("memory://gti-refresh-test/new/", "items", opts)  # a folder URI
    finally:
        fs.rm("memory://gti-refresh-test", recursive=True)


def test_cli_passes_only_the_flag_as_trust_remote_code(monkeypatch, tmp_path):
    from gti.cli import main
    from gti.refresh import command
    from gti.refresh.attempt import RefreshError

    got = []

    def fake_refresh(run_dir, items, interactions, overrides, **kw):
        got.append(kw["trust_remote_code"])
        raise RefreshError("stop here")

    monkeypatch.setattr(command, "refresh", fake_refresh)
    base = ["refresh", "--run-dir", str(tmp_path), "--items", "new.csv"]
    assert main(base) == 2 and main(base + ["--trust-remote-code"]) == 2
    assert got == [False, True]
