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
from gti.errors import ConfigError, DataError
from gti.eval import slices as S
from gti.eval.tables import format_table
from gti.stages import evaluate as E
from gti.train import sft_data

KS = [2, 5]
ITEMS = [f"i{j}" for j in range(12)]
CATALOG = ITEMS + ["VALID_ONLY", "TEST_ONLY"]
SMALL = ["eval.sasrec.epochs=2", "eval.sasrec.dim=16", "eval.sasrec.batch_size=32", "eval.sasrec.n_sample=8",
         "eval.sasrec.val_every=1", "eval.sasrec.threads=1", "eval.bootstrap=20", "data.max_history=5",
         "eval.ks=[2,5]"]


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
    names = {f"{m}@{k}" for m in ("recall", "ndcg", "precision") for k in KS}
    for split in ("valid", "test"):
        assert set(out["baselines"]["sasrec"][split]) == names
        for name in ("mostpop", "markov", "sasrec"):  # every reference row keeps its per-user values
            pu = out["baseline_per_user"][name][split]
            assert pu["user_ids"] == out["per_user"][split]["user_ids"]  # same users, same order: pairs up
            assert np.mean(pu["recall@5"]) == pytest.approx(out["baselines"][name][split]["recall@5"]["value"])
    # The cold slice gets the row too (its frames carry SASRec's lists).
    assert "sasrec" in out["slices"]["cold"]["test"]["baselines"]
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
