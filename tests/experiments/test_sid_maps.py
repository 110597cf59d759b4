"""gti/experiments/sid_maps.py: which SID maps a comparison trains on, and the figures over them
(built from fake run records: no pipeline runs)."""

from __future__ import annotations

import numpy as np
import pytest

from gti import config as C
from gti.diagnostics.runs import RunRecord
from gti.experiments.shared_stages import CompareError
from gti.experiments.sid_maps import HEADLINE, arm_users, headline, sid_seeds, summarize

USERS = [f"u{i}" for i in range(40)]


def _record(arm: str, seed: int, sid_seed: int, n_items: int = 100) -> RunRecord:
    """One run's metrics as the evaluate stage writes them: per-user hits, gains and exact ranks
    on the test split, their means as the split's figures (better for gti, varying by map)."""
    rng = np.random.default_rng([seed, sid_seed, arm == "gti"])
    top = (8 if arm == "gti" else 30) + 6 * sid_seed
    ranks = rng.integers(1, top + 1, size=len(USERS)).astype(float)
    hit = (ranks <= 10).astype(float)
    gain = np.where(ranks <= 10, 1 / np.log2(ranks + 1), 0.0)
    split = {"recall@10": {"value": float(hit.mean()), "ci": [0.0, 1.0]},
             "ndcg@10": {"value": float(gain.mean()), "ci": [0.0, 1.0]}}
    return RunRecord(arm=arm, seed=seed, metrics={
        "splits": {"test": split},
        "ranks": {"test": {"mrr": {"value": float((1 / ranks).mean()), "ci": [0.0, 1.0]},
                           "n_items": n_items, "n_users": len(USERS)}},
        "per_user": {"test": {"user_ids": USERS, "recall@10": hit.tolist(), "ndcg@10": gain.tolist(),
                              "exact_rank": ranks.tolist()}}})


def _by_map(maps=(0, 1, 2), seeds=(0, 1), arms=("mean", "gti")):
    return {m: [_record(a, s, m) for s in seeds for a in arms] for m in maps}


def test_sid_seeds_one_map_is_todays_and_several_count_from_the_base():
    assert sid_seeds(C.RunConfig(), 1) == [None]
    assert sid_seeds(C.validate({"seed": 4}, "t"), 3) == [4, 5, 6]
    assert sid_seeds(C.validate({"seed": 4, "sid": {"seed": 10}}, "t"), 2) == [10, 11]
    with pytest.raises(CompareError, match="--sid-seeds must be >= 1"):
        sid_seeds(C.RunConfig(), 0)


def test_mean_over_maps_is_the_mean_of_the_per_map_figures():
    by_map = _by_map()
    s = summarize(by_map, ["mean", "gti"], n_boot=200, seed=0)
    assert s["sid_seeds"] == [0, 1, 2] and s["split"] == "test" and list(s["per_map"]) == ["sid0", "sid1", "sid2"]
    for arm in ("mean", "gti"):
        for k in HEADLINE:
            per_map = []
            for m, recs in by_map.items():
                fig = s["per_map"][f"sid{m}"]["arms"][arm][k]
                block = "ranks" if k == "mrr" else "splits"
                seeds = [r.metrics[block]["test"][k]["value"] for r in recs if r.arm == arm]
                assert fig["value"] == pytest.approx(np.mean(seeds)) and fig["n_seeds"] == 2
                assert fig["ci"][0] <= fig["value"] <= fig["ci"][1]
                per_map.append(fig["value"])
            mean = s["mean"]["arms"][arm][k]
            assert mean["mean"] == pytest.approx(np.mean(per_map))
            assert mean["sd"] == pytest.approx(np.std(per_map, ddof=1))
            assert (mean["min"], mean["max"], mean["n_maps"]) == (min(per_map), max(per_map), 3)
            assert list(mean["per_map"].values()) == pytest.approx(per_map)
            assert mean["ci"][0] <= mean["mean"] <= mean["ci"][1]


def test_paired_differences_per_map_and_averaged_over_maps():
    by_map = _by_map()
    s = summarize(by_map, ["mean", "gti"], n_boot=200, seed=0)
    assert list(s["per_map"]["sid0"]["paired"]) == ["gti - mean"]  # later arm minus earlier
    diffs = []
    for m, recs in by_map.items():
        gti = arm_users([r for r in recs if r.arm == "gti"], "test", "recall@10")
        mean = arm_users([r for r in recs if r.arm == "mean"], "test", "recall@10")
        want = np.mean([gti[u] - mean[u] for u in USERS])
        got = s["per_map"][f"sid{m}"]["paired"]["gti - mean"]["recall@10"]
        assert got["value"] == pytest.approx(want) and got["n_users"] == len(USERS)
        assert got["ci"][0] <= got["value"] <= got["ci"][1]
        diffs.append(want)
        # the paired difference of the figures is the difference of the arms' figures (same users)
        figs = s["per_map"][f"sid{m}"]["arms"]
        assert want == pytest.approx(figs["gti"]["recall@10"]["value"] - figs["mean"]["recall@10"]["value"])
    avg = s["mean"]["paired"]["gti - mean"]["recall@10"]
    assert avg["mean"] == pytest.approx(np.mean(diffs)) and avg["n_maps"] == 3 and avg["n_users"] == len(USERS)
    assert avg["ci"][0] <= avg["mean"] <= avg["ci"][1] and avg["mean"] > 0
    assert set(s["mean"]["paired"]["gti - mean"]) == set(HEADLINE)


def test_runs_without_per_user_values_keep_their_figures_and_drop_only_the_pairing():
    by_map = _by_map(maps=(0, 1), seeds=(0,))
    for recs in by_map.values():
        for r in recs:
            del r.metrics["per_user"]
    s = summarize(by_map, ["mean", "gti"], n_boot=50)
    assert s["per_map"]["sid0"]["paired"]["gti - mean"] == {}
    assert s["mean"]["paired"]["gti - mean"] == {}
    assert s["mean"]["arms"]["gti"]["recall@10"]["n_maps"] == 2


def test_headline_puts_every_maps_figure_beside_the_mean():
    s = summarize(_by_map(), ["mean", "gti"], n_boot=50)
    lines = headline(s)
    assert len(lines) == 2 * len(HEADLINE)
    f = s["mean"]["arms"]["gti"]["recall@10"]
    line = next(ln for ln in lines if ln.startswith("gti recall@10:"))
    assert f"{f['mean']:.3f} mean over 3 SID maps" in line
    assert all(f"sid{m} {v:.3f}" in line for m, v in zip(range(3), f["per_map"].values()))
