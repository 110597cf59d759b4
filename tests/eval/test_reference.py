"""Reference rows of the evaluation table (gti/eval/reference.py) and their place in the evaluate
stage (gti/stages/evaluate.py), without Ray or an LM: the SASRec row needs its columns, and the
stage's metric path (`reference_frames` + `_metrics` + `format_table`) on hand-made decoded rows
gives the SASRec row beside MostPop and Markov, on the same users, with exact ranks over the
whole catalog."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import polars as pl
import pytest

from gti import config as C
from gti.eval import reference as R
from gti.common.errors import ConfigError, DataError
from gti.eval import slices as S
from gti.eval.tables import format_table
from gti.stages import evaluate as E
from gti.train import sft_data

KS = [2, 5]
ITEMS = [f"i{j}" for j in range(12)]
CATALOG = ITEMS + ["VALID_ONLY", "TEST_ONLY"]
SMALL = ["eval.sasrec.epochs=2", "eval.sasrec.dim=16", "eval.sasrec.batch_size=32", "eval.sasrec.n_sample=8",
         "eval.sasrec.val_every=1", "eval.sasrec.threads=1", "eval.bootstrap=20", "data.max_history=5",
         "eval.ks=[2,5]", "eval.sasrec.sweep.enabled=false"]


def _seqs() -> pl.DataFrame:
    """40 users on a 12-item cycle; VALID_ONLY is only a valid item, TEST_ONLY only a test item."""
    users, train, valid, test = [], [], [], []
    for u in range(40):
        seq = [ITEMS[(u + t) % 12] for t in range(4 + u % 4)]
        users.append(f"u{u}")
        train.append(seq[:-2])
        valid.append(seq[-2])
        test.append(seq[-1])
    valid[3], test[5] = "VALID_ONLY", "TEST_ONLY"
    return pl.DataFrame({"user_id": users, "train_items": train, "valid_item": valid, "test_item": test})


def test_baseline_rows_need_the_sasrec_columns():
    seqs = _seqs()
    frame = S.eval_windows(seqs, "test", 5)
    with pytest.raises(DataError, match="sasrec"):
        R.baseline_rows(seqs, "test", frame, KS, 0, 0, CATALOG, ["mostpop", "sasrec"])
    with pytest.raises(ConfigError, match="gru4rec"):
        R.baseline_rows(seqs, "test", frame, KS, 0, 0, CATALOG, ["gru4rec"])
    assert R.fit_reference_models(seqs, CATALOG, ["mostpop", "markov"], 5) == {}
    frames = {"test": frame}
    assert R.reference_frames(frames, seqs, CATALOG, ["markov"], 5, None, 0, 5, True) == (frames, {})


def _decoded(frame: pl.DataFrame) -> pl.DataFrame:
    """Decoded rows as the actor returns them: everyone gets the catalog in order, rank = row + 1."""
    row = {item: r for r, item in enumerate(CATALOG)}
    return frame.select("user_id", "split", "target").with_columns(
        items=pl.Series([CATALOG[:5]] * frame.height, dtype=pl.List(pl.String)),
        n_returned=pl.lit(5, dtype=pl.Int64), n_invalid=pl.lit(0, dtype=pl.Int64),
        exact_rank=pl.Series([float(row[t] + 1) for t in frame["target"].to_list()], dtype=pl.Float64),
    )


@pytest.mark.parametrize("exact_rank", [True, False])
def test_stage_metrics_have_the_sasrec_row(exact_rank):
    cfg = C.load(None, SMALL + [f"eval.exact_rank={str(exact_rank).lower()}"])
    seqs = _seqs()
    users = S.eval_users(seqs, None, 0)
    frames = {s: S.split_frame(seqs, s, users, 5) for s in ("valid", "test")}
    counts = sft_data.sft_target_counts(seqs)
    inp = E._Inputs(model_dir=None, sid_map_path=None, sid_facts={}, catalog=CATALOG, seqs=seqs, frames=frames,
                    rows=pl.concat(list(frames.values())), sft_counts=counts,
                    n_cold=S.n_cold_items(CATALOG, counts, 1))
    logs: list[str] = []
    ctx = SimpleNamespace(cfg=cfg, log=logs.append)
    ec = cfg.eval
    inp.frames, facts = R.reference_frames(inp.frames, seqs, CATALOG, ec.baselines, cfg.data.max_history,
                                           ec.sasrec.model_dump(), cfg.seed, max(ec.ks), ec.exact_rank, logs.append)
    assert facts["sasrec"]["train_seconds"] > 0 and facts["sasrec"]["n_windows"] == sum(
        len(t) - 1 for t in seqs["train_items"].to_list())
    recs = pl.concat([_decoded(inp.frames[s]) for s in ("valid", "test")])
    out = E._metrics(ctx, inp, recs)

    assert list(out["baselines"]) == ["mostpop", "markov", "sasrec"]
    assert facts["sasrec"]["label"] == "SASRec" and "sweep" not in facts["sasrec"]  # sweep off: one setting
    names = {f"{m}@{k}" for m in ("hr", "recall", "ndcg", "precision") for k in KS}
    for split in ("valid", "test"):
        assert set(out["baselines"]["sasrec"][split]) == names
        for name in ("mostpop", "markov", "sasrec"):  # every reference row keeps its per-user values
            pu = out["baseline_per_user"][name][split]
            assert pu["user_ids"] == out["per_user"][split]["user_ids"]  # same users, same order: pairs up
            assert np.mean(pu["recall@5"]) == pytest.approx(out["baselines"][name][split]["recall@5"]["value"])
            # Paired: model - row, the mean of the per-user differences, inside its bootstrap CI.
            model = out["per_user"][split]
            for metric in ("recall@5", "ndcg@5", "recall@2"):
                cell = out["paired"][split][name][metric]
                assert cell["value"] == pytest.approx(np.mean(np.subtract(model[metric], pu[metric])))
                assert cell["ci"][0] <= cell["value"] <= cell["ci"][1] and cell["n_users"] == seqs.height
            mrr = "mrr" if exact_rank and name == "sasrec" else "mrr@5"  # exact only where both rank everything
            assert set(out["paired"][split][name]) == {f"{m}@{k}" for m in ("recall", "ndcg") for k in KS} | {mrr}
    # The cold slice gets the row too (its frames carry SASRec's lists).
    assert "sasrec" in out["slices"]["cold"]["test"]["baselines"]
    paired = E.format_paired(out)  # logged after the table: the headline K (5 here), model - row
    assert any(ln.startswith(f"test: model - sasrec (paired, {seqs.height} users): Recall@5 ") for ln in paired)
    assert len(paired) == 2 * 3 and all("NDCG@5" in ln and "MRR" in ln for ln in paired)
    text = format_table(out, KS)
    for row in ("test/sft", "test/mostpop", "test/markov", "test/sasrec", "valid/sasrec"):
        assert any(line.split()[0] == row for line in text.splitlines()), text
    if exact_rank:
        ranks = out["baseline_ranks"]["sasrec"]["test"]
        assert ranks["n_items"] == len(CATALOG) and ranks["n_users"] == seqs.height
        r = out["baseline_per_user"]["sasrec"]["test"]["exact_rank"]
        assert r[5] == len(CATALOG) - 0.5  # TEST_ONLY: never trained on, tied last with VALID_ONLY
        top5 = out["baseline_per_user"]["sasrec"]["test"]["recall@5"]
        assert all((rank <= 5) == bool(hit) for rank, hit in zip(r, top5))  # ranks agree with the lists
        assert any("/sasrec: MRR" in line for line in logs)
        assert "sasrec" in out["slices"]["cold"]["test"]["baseline_ranks"]
    else:
        assert out["baseline_ranks"] == {} and "exact_rank" not in out["baseline_per_user"]["sasrec"]["test"]


def test_paired_differences_match_per_user_differences_on_the_same_users():
    rng = np.random.default_rng(0)
    users = [f"u{i}" for i in range(50)]
    model = {"user_ids": users, "recall@10": rng.integers(0, 2, 50).tolist(),
             "ndcg@10": (rng.integers(0, 2, 50) / np.log2(rng.integers(0, 10, 50) + 2)).tolist(),
             "exact_rank": rng.integers(1, 100, 50).astype(float).tolist()}
    base = {k: list(v) for k, v in model.items()}
    base["recall@10"] = rng.integers(0, 2, 50).tolist()
    base["exact_rank"] = rng.integers(1, 100, 50).astype(float).tolist()
    flip = list(range(50))[::-1]  # the row lists its users in another order: matched by id
    shuffled = {k: [v[i] for i in flip] for k, v in base.items()}
    out = R.paired_differences(model, {"sasrec": shuffled, "markov": {k: v for k, v in shuffled.items()
                                                                     if k != "exact_rank"}}, [10], 200, 0)
    d = out["sasrec"]["recall@10"]
    assert d["value"] == pytest.approx(np.mean(np.subtract(model["recall@10"], base["recall@10"])))
    assert d["ci"][0] <= d["value"] <= d["ci"][1] < 1 and d["n_users"] == 50
    assert out["sasrec"]["ndcg@10"]["value"] == 0.0 and out["sasrec"]["ndcg@10"]["ci"] == [0.0, 0.0]
    exact = out["sasrec"]["mrr"]["value"]  # both sides rank the whole catalog: exact MRR
    assert exact == pytest.approx(np.mean(1 / np.array(model["exact_rank"]) - 1 / np.array(base["exact_rank"])))
    assert "mrr" not in out["markov"] and out["markov"]["mrr@10"]["value"] == 0.0  # same top-10 ranks
    assert set(out["markov"]) == {"recall@10", "ndcg@10", "mrr@10"}
    with pytest.raises(DataError, match="other users"):
        R.paired_differences(model, {"markov": dict(base, user_ids=users[:-1] + ["x"])}, [10], 10, 0)
    nd = [0.0, 1.0, 1 / np.log2(3), 1 / np.log2(11)]  # misses, ranks 1, 2 and 10
    np.testing.assert_allclose(R.reciprocal_ranks_at_k(nd), [0.0, 1.0, 0.5, 0.1])


def test_sasrec_reads_its_own_history_not_the_lm_window(monkeypatch):
    """SASRec's input per split is the split's whole training sequence (it keeps its own last
    max_len): valid -> train items, test -> train items + valid item; never the target, and
    not the LM's data.max_history window of the split frame."""
    seqs = _seqs()
    seen = {}

    class Fake:
        facts = {"train_seconds": 1.0, "label": "SASRec", "max_len": 50}

        def ranked_and_ranks(self, histories, targets, k, exact):
            seen[targets[0]] = histories
            return [["i0"] * k] * len(histories), ([1.0] * len(histories) if exact else None)

    monkeypatch.setattr(R, "fit_reference_models", lambda *a, **k: {"sasrec": Fake()})
    frames = {s: S.eval_windows(seqs, s, 2).reverse() for s in ("valid", "test")}  # the LM's window: 2 items
    R.reference_frames(frames, seqs, CATALOG, ["sasrec"], 2, None, 0, 5, True)
    for split in ("valid", "test"):
        hist = seen[frames[split]["target"][0]]
        for h, row in zip(hist, seqs.reverse().iter_rows(named=True)):
            assert h == row["train_items"] + ([row["valid_item"]] if split == "test" else [])
        assert max(len(h) for h in hist) > 2


def _time_split_seqs() -> pl.DataFrame:
    """40 users of 4..7 items on the 12-item cycle, cut 6:2:2 by time (several rows per user)."""
    from gti.data.sequences import build_sequences

    rows = [(f"u{u}", ITEMS[(u + t) % 12], t * 40 + u) for u in range(40) for t in range(4 + u % 4)]
    df = pl.DataFrame({"user_id": [r[0] for r in rows], "item_id": [r[1] for r in rows],
                       "ts": [r[2] for r in rows], "order": list(range(len(rows)))})
    return build_sequences(df, 2, None, "global_time", ratios=(6, 2, 2)).sequences


def test_time_split_every_row_scored_paired_by_row_and_sasrec_reads_all_before_it(monkeypatch):
    cfg = C.load(None, SMALL + ["eval.baselines=[mostpop,markov,sasrec]"])
    seqs = _time_split_seqs()
    seen: dict[str, list] = {}

    class Fake:
        facts = {"train_seconds": 1.0, "label": "SASRec", "max_len": 50}

        def ranked_and_ranks(self, histories, targets, k, exact):
            seen.setdefault("h", []).extend(histories)
            return [["i0"] * k] * len(histories), None

    monkeypatch.setattr(R, "fit_reference_models", lambda *a, **k: {"sasrec": Fake()})
    users = S.eval_users(seqs, None, 0)
    frames = {s: S.split_frame(seqs, s, users, 5) for s in ("valid", "test")}
    assert frames["test"].height > frames["test"]["user_id"].n_unique()  # several rows of a user
    counts = sft_data.sft_target_counts(seqs)
    inp = E._Inputs(model_dir=None, sid_map_path=None, sid_facts={}, catalog=CATALOG, seqs=seqs, frames=frames,
                    rows=pl.concat(list(frames.values())), sft_counts=counts, n_cold=0)
    inp.frames, _ = R.reference_frames(frames, seqs, CATALOG, cfg.eval.baselines, 5, None, 0, 5, False)
    # SASRec reads every item before the row's target, not the LM's last 5.
    full = {r["user_id"]: r["train_items"] + r["valid_items"] + r["test_items"] for r in seqs.iter_rows(named=True)}
    f = pl.concat([inp.frames["valid"], inp.frames["test"]])
    assert seen["h"] == [full[u][:p] for u, p in zip(f["user_id"].to_list(), f["pos"].to_list())]
    assert max(len(h) for h in seen["h"]) > 5
    recs = pl.concat([_decoded(inp.frames[s]) for s in ("valid", "test")])
    out = E._metrics(SimpleNamespace(cfg=cfg, log=lambda m: None), inp, recs)
    for split in ("valid", "test"):
        n_rows, n_users = frames[split].height, frames[split]["user_id"].n_unique()
        assert (out["n_rows"][split], out["n_users"][split]) == (n_rows, n_users)
        assert len(out["per_user"][split]["user_ids"]) == n_rows  # one value per row
        cell = out["paired"][split]["markov"]["recall@5"]
        assert (cell["n_users"], cell["n_rows"]) == (n_users, n_rows)
        assert out["splits"][split]["hr@5"]["value"] == pytest.approx(np.mean(out["per_user"][split]["recall@5"]))
    assert f"test={out['n_users']['test']} ({out['n_rows']['test']} rows)" in format_table(out, KS)


def test_paired_differences_pair_rows_of_a_repeated_user_in_order():
    model = {"user_ids": ["a", "a", "b"], "recall@5": [1, 0, 1], "ndcg@5": [1.0, 0.0, 0.5]}
    base = {"user_ids": ["b", "a", "a"], "recall@5": [0, 0, 1], "ndcg@5": [0.0, 0.0, 1.0]}
    out = R.paired_differences(model, {"markov": base}, [5], 50, 0)["markov"]
    assert out["recall@5"]["value"] == pytest.approx(((1 - 0) + (0 - 1) + (1 - 0)) / 3)
    assert (out["recall@5"]["n_users"], out["recall@5"]["n_rows"]) == (2, 3)
    assert R.row_keys(["a", "b", "a"]) == [("a", 0), ("b", 0), ("a", 1)]
    with pytest.raises(DataError, match="other users"):
        R.paired_differences(model, {"markov": dict(base, user_ids=["b", "a", "b"])}, [5], 10, 0)


def test_sasrec_valid_rows_are_every_valid_row_with_all_before_it():
    seqs = _time_split_seqs()
    ids, hist, targets = R.valid_rows(seqs)
    w = S.eval_windows(seqs, "valid", 100)
    assert targets == w["target"].to_list() and hist == w["history"].to_list()
    assert len(set(ids)) == len(ids) and ids[0].startswith(w["user_id"][0] + "#")
    loo = _seqs()
    ids, hist, targets = R.valid_rows(loo)  # leave-one-out: one per user, the user id, as before
    assert ids == loo["user_id"].to_list() and hist == loo["train_items"].to_list()
    assert targets == loo["valid_item"].to_list()
