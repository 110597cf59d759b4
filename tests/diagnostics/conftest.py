"""Run records for the report tests: three arms x two seeds, with and without per-user values,
exact ranks, a cold slice, learning curves and timing (built in memory, no runs needed)."""

from __future__ import annotations

import numpy as np

from gti.diagnostics import geometry as G
from gti.diagnostics.runs import RunRecord

ARMS = ["mean", "gti", "gti+multitask"]


def _metrics(r10, r5, seed, per_user=None):
    m = {
        "splits": {"test": {
            "recall@10": {"value": r10, "ci": [r10 - 0.01, r10 + 0.01]},
            "ndcg@5": {"value": r5, "ci": [r5 - 0.005, r5 + 0.005]},
        }},
        "baselines": {"mostpop": {"test": {"recall@10": {"value": 0.03, "ci": [0.02, 0.04]}}},
                      "markov": {"test": {"recall@10": 0.08}}},
        "invalid_sid_rate": 0.001 * seed,
    }
    if per_user is not None:
        m["per_user"] = {"test": {"user_ids": [f"u{i}" for i in range(len(per_user))],
                                  "recall@10": list(per_user), "ndcg@5": list(per_user / 2)}}
    return m


def _diag(rng, rank1=False):
    sizes = [6, 6]
    codes = [rng.normal(size=(6, 3)), rng.normal(size=(6, 3))]
    E = np.tile(rng.normal(size=(1, 8)), (12, 1)) if rank1 else rng.normal(size=(12, 8))
    return G.diagnose(E, sizes, codes, rng.normal(size=(20, 8)))


def make_records(per_user=False):
    rng = np.random.default_rng(0)
    recs = []
    base = {"mean": 0.10, "gti": 0.12, "gti+multitask": 0.13}
    for arm in ARMS:
        for seed in (0, 1):
            r10 = base[arm] + 0.01 * seed
            pu = rng.binomial(1, r10, size=200).astype(float) if per_user else None
            if per_user:  # the reported value is the mean of the per-user values
                r10 = float(pu.mean())
            recs.append(RunRecord(
                arm=arm, seed=seed, metrics=_metrics(r10, r10 / 2, seed, pu),
                diagnostics={"init": _diag(rng, rank1=arm == "mean"), "sft": _diag(rng)},
                config={"init": {"method": "mean"}, "arm": arm}, versions={"torch": "x"},
                run_dir=f"/runs/{arm}/seed{seed}",
            ))
    return recs


# --------------------------------------------------------------------------- exact ranks, cold
# slice, learning curves, wall time
N_ITEMS = 101


def _rank_block(ranks, n_items=N_ITEMS):
    r = np.asarray(ranks, dtype=float)
    rr, pct = 1.0 / r, (r - 1) / (n_items - 1)
    return {"mrr": {"value": float(rr.mean()), "ci": [float(rr.mean()) * 0.9, float(rr.mean()) * 1.1]},
            "mean_percentile_rank": {"value": float(pct.mean()),
                                     "ci": [float(pct.mean()) * 0.9, float(pct.mean()) * 1.1]},
            "median_rank": float(np.median(r)), "mean_rank": float(r.mean()),
            "n_users": int(r.size), "n_items": n_items}


def _cold_block(r10, mrr, n_users):
    return {"n_users": n_users,
            "model": {"recall@10": {"value": r10, "ci": [r10 - 0.02, r10 + 0.02]}},
            "baselines": {"mostpop": {"recall@10": {"value": 0.01, "ci": [0.0, 0.02]}}},
            "ranks": {"mrr": {"value": mrr, "ci": [mrr - 0.01, mrr + 0.01]},
                      "mean_percentile_rank": {"value": 0.5 - mrr, "ci": [0.45 - mrr, 0.55 - mrr]}}}


# arm -> (max rank of its users' targets: smaller = better, cold recall@10, cold mrr)
RANK_ARMS = {"mean": (60, 0.02, 0.05), "gti": (15, 0.06, 0.12), "random": (100, 0.01, 0.02)}


def make_rank_records(cold=True, curves=True, timing=True):
    rng = np.random.default_rng(3)
    recs = []
    for arm, (top, c10, cmrr) in RANK_ARMS.items():
        for seed in (0, 1):
            ranks = rng.integers(1, top + 1, size=150).astype(float)
            hits = (ranks <= 10).astype(float)
            m = {
                "splits": {"test": {"recall@10": {"value": float(hits.mean()), "ci": [0.0, 1.0]}}},
                "baselines": {}, "invalid_sid_rate": 0.0,
                "ranks": {"test": _rank_block(ranks)},
                "per_user": {"test": {"user_ids": [f"u{i}" for i in range(150)], "recall@10": hits.tolist(),
                                      "exact_rank": ranks.tolist()}},
            }
            if cold:
                m["slices"] = {"cold": {
                    "definition": {"max_sft_targets": 1, "n_cold_items": 30, "n_items": N_ITEMS},
                    "test": _cold_block(c10 + 0.01 * seed, cmrr + 0.01 * seed, 40 + seed),
                }}
            cv = {}
            if curves:
                # gti starts ahead and stays ahead on val_mrr; val_loss: gti lower (better)
                start = {"mean": 0.01, "gti": 0.05, "random": 0.005}[arm]
                cv = {"val_mrr": [[s, start + 0.001 * s + 0.002 * seed] for s in (10, 20, 30)],
                      "val_loss": [[s, 3.0 - 10 * start - 0.01 * s + 0.05 * seed] for s in (10, 20, 30)]}
            tm = {}
            if timing:
                tm = {"ground_s": 100.0 + seed if arm == "gti" else 5.0, "sft_s": 200.0 + 2 * seed,
                      "sft_compute_s": 150.0, "grounding": arm == "gti"}
            recs.append(RunRecord(arm=arm, seed=seed, metrics=m, run_dir=f"/r/{arm}/{seed}",
                                  curves=cv, timing=tm))
    return recs
