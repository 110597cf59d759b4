"""SASRec reference row (gti/eval/sasrec.py, cornac's PyTorch SASRec): it learns the
deterministic learnability walk, never trains on valid/test items, scores in batches exactly as
cornac's own per-user `score`, and is deterministic given a seed. No Ray, no LM."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import polars as pl

from gti.data import synth
from gti.data.sequences import build_sequences
from gti.eval import metrics as M
from gti.eval.rank import rank_metrics
from gti.eval.sasrec import SasrecParams, fit_sasrec, training_sessions, validation_sessions


# Small and quick: a 37-item walk has 37 transitions to learn.
WALK_PARAMS = SasrecParams(epochs=3, dim=32, lr=1e-2, batch_size=128, n_sample=0, val_every=1,
                           val_users=100, threads=1)


def _walk_sequences(tmp_path, n_items: int, seed: int) -> pl.DataFrame:
    synth.generate_walk(n_items, 20 * n_items, tmp_path / "walk", seed=seed, log=lambda m: None)
    inter = pl.read_parquet(tmp_path / "walk" / "interactions")
    df = inter.select(pl.col("user_id").cast(pl.String), pl.col("item_id").cast(pl.String),
                      pl.col("ts").cast(pl.Int64)).with_row_index("order").with_columns(pl.col("order").cast(pl.Int64))
    return build_sequences(df, 3).sequences


def _fit(seqs: pl.DataFrame, catalog, params=WALK_PARAMS, seed=0, max_history=5):
    return fit_sasrec(seqs["user_id"].to_list(), seqs["train_items"].to_list(), seqs["valid_item"].to_list(),
                      catalog, max_history, params, seed=seed)


def _test_prompts(seqs: pl.DataFrame, h: int):
    hist = [(t + [v])[-h:] for t, v in zip(seqs["train_items"].to_list(), seqs["valid_item"].to_list())]
    return hist, seqs["test_item"].to_list()


def test_sasrec_learns_the_learnability_walk(tmp_path):
    n = 37
    seqs = _walk_sequences(tmp_path, n, seed=11)
    catalog = [str(i) for i in range(n)]
    t0 = time.time()
    model = _fit(seqs, catalog)
    seconds = time.time() - t0
    hist, targets = _test_prompts(seqs, 5)
    ranked, ranks = model.ranked_and_ranks(hist, targets, 10, exact=True)
    table = M.metrics_table(ranked, targets, [10], n_boot=0)
    rm = rank_metrics(ranks, n, 0)
    print(f"walk {n}: SASRec test Recall@10 {table['recall@10']['value']:.3f}, "
          f"MRR {rm['mrr']['value']:.3f}, trained in {seconds:.1f}s ({model.facts})")
    assert table["recall@10"]["value"] >= 0.9, table
    assert rm["mrr"]["value"] >= 0.5, rm
    assert model.facts["n_windows"] == sum(len(t) - 1 for t in seqs["train_items"].to_list())
    assert model.facts["n_val_users"] == 100 and model.facts["train_seconds"] > 0


def _planted() -> tuple[pl.DataFrame, list[str]]:
    """Sequences where VALID_ONLY is only a valid item and TEST_ONLY only a test item."""
    rng = np.random.default_rng(0)
    items = [f"i{j}" for j in range(12)]
    users, train, valid, test = [], [], [], []
    for u in range(60):
        seq = [items[(u + t) % 12] for t in range(int(rng.integers(4, 9)))]
        users.append(f"u{u}")
        train.append(seq[:-2])
        valid.append(seq[-2])
        test.append(seq[-1])
    valid[3] = "VALID_ONLY"
    test[5] = "TEST_ONLY"
    seqs = pl.DataFrame({"user_id": users, "train_items": train, "valid_item": valid, "test_item": test})
    return seqs, items + ["VALID_ONLY", "TEST_ONLY"]


def test_training_never_sees_valid_or_test_targets(monkeypatch):
    from cornac.models import SASRec

    seqs, catalog = _planted()
    rows = training_sessions(seqs["train_items"].to_list(), seqs["user_id"].to_list())
    trained_items = {r[2] for r in rows}
    assert "TEST_ONLY" not in trained_items and "VALID_ONLY" not in trained_items
    # Validation sessions (selection only) drop a valid item the model cannot know.
    vrows = validation_sessions(seqs["train_items"].to_list(), seqs["valid_item"].to_list(),
                                seqs["user_id"].to_list(), trained_items, 5, None, 0)
    assert "u3" not in {r[0] for r in vrows} and "TEST_ONLY" not in {r[2] for r in vrows}

    # What cornac is actually handed: capture the training set inside fit.
    seen = {}
    real_fit = SASRec.fit

    def spy(self, train_set, val_set=None):
        seen["train"] = set(train_set.iid_map)  # includes every item in the training sessions
        inv = {v: k for k, v in train_set.iid_map.items()}
        seen["targets"] = {inv[i] for i in train_set.uir_tuple[1]}
        seen["val"] = None if val_set is None else {inv[i] for i in val_set.uir_tuple[1]}
        return real_fit(self, train_set, val_set)

    monkeypatch.setattr(SASRec, "fit", spy)
    params = SasrecParams(epochs=1, dim=8, batch_size=16, n_sample=4, val_every=1, threads=1)
    model = _fit(seqs, catalog, params)
    for key in ("train", "targets", "val"):
        assert "TEST_ONLY" not in seen[key] and "VALID_ONLY" not in seen[key], key
    assert "TEST_ONLY" not in model.model.iid_map and "VALID_ONLY" not in model.model.iid_map
    # Items it never saw score -inf and rank last (tied), wherever they are in the catalog.
    sc = model.scores([["i1", "i2"]])
    assert np.isneginf(sc[0, -2:]).all() and np.isfinite(sc[0, :-2]).all()
    _, ranks = model.ranked_and_ranks([["i1", "i2"]], ["TEST_ONLY"], 5, exact=True)
    assert ranks == [len(catalog) - 0.5]  # mid-rank of the 2 unknown items at the bottom


def test_batched_scores_equal_cornac_score_and_are_deterministic():
    seqs, catalog = _planted()
    params = SasrecParams(epochs=2, dim=16, batch_size=32, n_sample=8, val_every=1, threads=1, batch_users=7)
    a = _fit(seqs, catalog, params, seed=3)
    b = _fit(seqs, catalog, params, seed=3)
    hist = [t[-5:] for t in seqs["train_items"].to_list()][:20] + [["i1", "UNSEEN", "i2"]]
    sa, sb = a.scores(hist), b.scores(hist)
    np.testing.assert_array_equal(sa, sb)  # same seed, same model
    iid = a.model.iid_map
    cols = [catalog.index(item) for item in iid]
    for r, h in enumerate(hist):
        ref = a.model.score(0, [iid[i] for i in h if i in iid])  # cornac's own per-user scoring
        np.testing.assert_allclose(sa[r, cols], ref, rtol=1e-5, atol=1e-5)
    top = a.recommend(hist[:3], 4)
    assert all(len(t) == 4 and "TEST_ONLY" not in t for t in top)
    c = _fit(seqs, catalog, params, seed=4)
    assert not np.array_equal(c.scores(hist), sa)


# --------------------------------------------------------------------------- tuning on valid
def _lag2(n_users: int = 150, n_items: int = 20, length: int = 9, seed: int = 0):
    """Sequences where item t = PERM[item t-2] (the first two random): the last item alone says
    nothing about the next one, the last two say everything. Valid and test items follow the
    same rule, so on the valid split max_len 3 beats max_len 1. Test items are then replaced by
    TEST_<u> items no other split holds, so any use of them shows."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n_items)
    users, train, valid, test = [], [], [], []
    for u in range(n_users):
        seq = [int(x) for x in rng.integers(0, n_items, 2)]
        while len(seq) < length:
            seq.append(int(perm[seq[-2]]))
        users.append(f"u{u}")
        train.append([f"i{x}" for x in seq[:-2]])
        valid.append(f"i{seq[-2]}")
        test.append(f"TEST_{u}")
    seqs = pl.DataFrame({"user_id": users, "train_items": train, "valid_item": valid, "test_item": test})
    return seqs, [f"i{j}" for j in range(n_items)] + test


LAG_PARAMS = SasrecParams(epochs=8, dim=16, lr=1e-2, batch_size=64, n_sample=0, val_every=2, val_users=50,
                          threads=1)
LAG_SWEEP = {"enabled": True, "search": "axes", "max_len": ["history", 3], "epochs": [8], "dim": [16],
             "dropout": [0.1], "metric": "mrr", "val_users": None}


def test_tuned_sasrec_picks_max_len_on_the_valid_split_only(monkeypatch):
    """data.max_history = 1 ("history") against 3: the valid split needs two items of history,
    so the sweep keeps max_len 3; every candidate is recorded with its valid score and wall
    time; no test item reaches cornac's training or validation sets or the valid scoring."""
    from cornac.models import SASRec

    from gti.eval import reference as R
    from gti.eval import sasrec as S

    seqs, catalog = _lag2()
    seen: list[set] = []
    real_fit, real_scores = SASRec.fit, S.valid_scores

    def spy_fit(self, train_set, val_set=None):
        inv = {v: k for k, v in train_set.iid_map.items()}
        seen.append(set(train_set.iid_map) | {inv[i] for i in train_set.uir_tuple[1]})
        if val_set is not None:
            seen.append({inv[i] for i in val_set.uir_tuple[1]})
        return real_fit(self, train_set, val_set)

    def spy_scores(model, hist, targets):
        seen.append(set(targets) | {i for h in hist for i in h})
        return real_scores(model, hist, targets)

    monkeypatch.setattr(SASRec, "fit", spy_fit)
    monkeypatch.setattr(S, "valid_scores", spy_scores)
    cfg = dict(vars(LAG_PARAMS), sweep=LAG_SWEEP, max_len=None)
    model = R.fit_reference_models(seqs, catalog, ["sasrec"], 1, cfg, seed=0)["sasrec"]
    sweep = model.facts["sweep"]
    by_len = {c["settings"]["max_len"]: c for c in sweep["candidates"]}
    print({k: c["valid"] for k, c in by_len.items()})
    assert set(by_len) == {1, 3} and sweep["chosen"]["max_len"] == 3 and model.max_len == 3
    assert by_len[3]["valid"]["mrr"] > by_len[1]["valid"]["mrr"] + 0.2
    assert model.facts["label"] == S.TUNED_LABEL and model.facts["max_len"] == 3
    assert sweep["metric"] == "mrr" and sweep["n_users"] == seqs.height
    assert all(c["train_seconds"] > 0 and c["score_seconds"] >= 0 for c in sweep["candidates"])
    assert sweep["wall_seconds"] >= sum(c["train_seconds"] for c in sweep["candidates"])
    assert seen and not any(i.startswith("TEST_") for s in seen for i in s)

    # The test column plays no part: other test items, the same sweep to the last digit.
    other = seqs.with_columns(test_item=pl.Series([f"i{j % 20}" for j in range(seqs.height)]))
    again = R.fit_reference_models(other, catalog, ["sasrec"], 1, cfg, seed=0)["sasrec"].facts["sweep"]
    assert [c["valid"] for c in again["candidates"]] == [c["valid"] for c in sweep["candidates"]]


def _fake_search(monkeypatch, score):
    """fit_sasrec / valid_scores replaced: no training, a valid MRR given by score(settings)."""
    from gti.eval import sasrec as S

    calls = []

    def fake_fit(users, train, valid, catalog, max_len, p, seed=0, log=None):
        calls.append({"max_len": max_len, "epochs": p.epochs, "dim": p.dim, "dropout": p.dropout})
        return SimpleNamespace(settings=calls[-1], facts={}, max_len=max_len)

    monkeypatch.setattr(S, "fit_sasrec", fake_fit)
    monkeypatch.setattr(S, "valid_scores", lambda m, h, t: {"mrr": score(m.settings), "recall@10": 0.0,
                                                             "n_users": len(t)})
    return calls


def test_sweep_searches_axes_or_grid_and_keeps_the_best(monkeypatch):
    from gti.eval import sasrec as S

    def score(s):  # best: max_len 20, dim 32, dropout 0.5 (epochs do not matter)
        return (s["max_len"] == 20) + 0.5 * (s["dim"] == 32) + 0.25 * (s["dropout"] == 0.5)

    calls = _fake_search(monkeypatch, score)
    sweep = {"enabled": True, "search": "axes", "max_len": ["history", 20, 3], "epochs": [5, 10], "dim": [16, 32],
             "dropout": [0.2, 0.5], "metric": "mrr", "val_users": 4}
    users, train, valid = ["a", "b", "c", "d", "e"], [["x"]] * 5, ["y"] * 5
    m = S.tune_sasrec(users, train, valid, ["x", "y"], 3, SasrecParams(), sweep, seed=0)
    # Axes: dropout, dim, epochs at the first length ("history" = 3), then the other lengths once
    # ("history" = 3 is listed twice: trained once).
    assert calls == [{"max_len": 3, "epochs": 5, "dim": 16, "dropout": 0.2}, {"max_len": 3, "epochs": 5, "dim": 16,
                     "dropout": 0.5}, {"max_len": 3, "epochs": 5, "dim": 32, "dropout": 0.5},
                     {"max_len": 3, "epochs": 10, "dim": 32, "dropout": 0.5}, {"max_len": 20, "epochs": 5, "dim": 32,
                                                                               "dropout": 0.5}]
    assert m.facts["sweep"]["chosen"] == {"dropout": 0.5, "dim": 32, "epochs": 5, "max_len": 20}
    assert m.settings == m.facts["sweep"]["chosen"] and m.facts["sweep"]["n_users"] == 4
    calls.clear()
    m = S.tune_sasrec(users, train, valid, ["x", "y"], 3, SasrecParams(), dict(sweep, search="grid"), seed=0)
    assert len(calls) == 2 * 2 * 2 * 2 and m.facts["sweep"]["chosen"]["dim"] == 32
    assert S.sweep_axes(sweep, 20)["max_len"] == [20, 3]


def test_sweep_off_trains_one_fixed_setting(monkeypatch):
    from gti.eval import reference as R
    from gti.eval import sasrec as S

    calls = _fake_search(monkeypatch, lambda s: 0.0)
    seqs = pl.DataFrame({"user_id": ["a"], "train_items": [["x", "y"]], "valid_item": ["y"], "test_item": ["x"]})
    off = {"enabled": False, **{k: v for k, v in LAG_SWEEP.items() if k != "enabled"}}
    m = R.fit_reference_models(seqs, ["x", "y"], ["sasrec"], 4, {"epochs": 3, "sweep": off}, seed=0)["sasrec"]
    assert calls == [{"max_len": 4, "epochs": 3, "dim": 64, "dropout": 0.2}] and "sweep" not in m.facts
    R.fit_reference_models(seqs, ["x", "y"], ["sasrec"], 4, {"max_len": 9, "sweep": off}, seed=0)
    assert calls[-1]["max_len"] == 9  # eval.sasrec.max_len, decoupled from data.max_history


def test_sweep_config_default_and_checks():
    """eval.sasrec.sweep (gti.config.eval): on by default with max_len {history, 20, 50}, MRR on
    valid; every swept dim must split into the heads; a max_len below 1 is refused."""
    import pytest

    from gti import config as C
    from gti.common.errors import ConfigError

    sw = C.load(None).eval.sasrec.sweep
    assert sw.enabled and sw.max_len == ["history", 20, 50] and sw.metric == "mrr" and sw.search == "axes"
    assert 1 + sum(len(getattr(sw, a)) - 1 for a in ("dropout", "dim", "epochs", "max_len")) == 6
    with pytest.raises(ConfigError, match="eval.sasrec"):
        C.load(None, ["eval.sasrec.heads=3", "eval.sasrec.dim=63"])  # the fixed dim splits, the swept do not
    assert C.load(None, ["eval.sasrec.heads=3", "eval.sasrec.dim=63", "eval.sasrec.sweep.enabled=false"])
    with pytest.raises(ConfigError, match="max_len"):
        C.load(None, ["eval.sasrec.sweep.max_len=[0,20]"])


def test_valid_rows_of_the_time_split_select_the_checkpoint(monkeypatch):
    """With valid_histories / valid_ids (the global time split's valid rows, several per user,
    session ids `user#pos`), cornac's validation set is those rows: each history + its target."""
    from cornac.models import SASRec

    seqs, catalog = _planted()
    seen = {}
    real_fit = SASRec.fit

    def spy(self, train_set, val_set=None):
        seen["val_users"] = None if val_set is None else set(val_set.uid_map)
        return real_fit(self, train_set, val_set)

    monkeypatch.setattr(SASRec, "fit", spy)
    hists = [["i1", "i2"], ["i1", "i2", "i3"], ["i5"]]
    ids = ["u1#2", "u1#3", "u7#1"]
    params = SasrecParams(epochs=1, dim=8, batch_size=16, n_sample=4, val_every=1, threads=1)
    model = fit_sasrec(seqs["user_id"].to_list(), seqs["train_items"].to_list(), ["i3", "i4", "i6"], catalog, 5,
                       params, valid_histories=hists, valid_ids=ids)
    assert set(ids) <= seen["val_users"] and model.facts["n_val_users"] == 3
    assert model.facts["selection"].startswith("best valid")
