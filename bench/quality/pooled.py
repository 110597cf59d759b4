"""Figures over several SID maps with one CI each: a model against the baselines, or one model
against another (a lift), paired by row over the same users.

Reads OUT/sid<k>/evaluate/metrics.json as `bench/quality/maps.sh` writes them. Each row's figure
is averaged over the maps first (the maps are evaluated on the same rows), then the difference is
resampled by user with all of that user's rows (rows of one user are not independent draws).
It knows nothing of how the runs were made; two folders compared must hold the same maps.

Usage: python bench/quality/pooled.py OUT                  # model - each baseline
       python bench/quality/pooled.py OUT --against OUT_B  # model of OUT - model of OUT_B, per map and pooled
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys

import numpy as np

KEYS = ("recall@10", "ndcg@10")


def load_maps(out: str) -> dict[int, dict]:
    """{sid_seed: metrics.json} of every finished map in OUT."""
    found = {}
    for f in sorted(glob.glob(f"{out}/sid*/evaluate/metrics.json")):
        found[int(re.search(r"/sid(\d+)/evaluate/", f).group(1))] = json.load(open(f))
    return found


def user_boot(d: np.ndarray, users: list, n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of per-row differences d [rows] and its 95% CI, users resampled
    with all their rows."""
    uid, inv = np.unique(np.asarray(users, dtype=str), return_inverse=True)
    sums, counts = np.bincount(inv, weights=d), np.bincount(inv)
    pick = np.random.default_rng(seed).integers(0, len(uid), (n, len(uid)))
    boots = sums[pick].sum(axis=1) / counts[pick].sum(axis=1)
    lo, hi = np.quantile(boots, [0.025, 0.975])
    return float(d.mean()), float(lo), float(hi)


def _aligned(per: dict, users: list, k: str, what: str) -> np.ndarray:
    """per[k] [rows] in the order of `users` (row-aligned, or reordered when users are unique)."""
    if per["user_ids"] == users:
        return np.asarray(per[k], dtype=float)
    if len(set(users)) == len(users) and sorted(per["user_ids"]) == sorted(users):
        order = {u: i for i, u in enumerate(per["user_ids"])}
        return np.asarray(per[k], dtype=float)[[order[u] for u in users]]
    sys.exit(f"{what}: rows are not those of the model (other users, or repeated users in another order)")


def _model_rows(runs: list[dict], split: str, k: str, what: str) -> tuple[np.ndarray, list]:
    """Each row's figure averaged over the maps [rows], and the rows' users."""
    users = runs[0]["per_user"][split]["user_ids"]
    if any(r["per_user"][split]["user_ids"] != users for r in runs):
        sys.exit(f"{what} split {split}: the maps were evaluated on different users")
    return np.mean([r["per_user"][split][k] for r in runs], axis=0), users


def against_baselines(out: str) -> list[str]:
    """One line per split, metric and baseline: model - baseline, mean over maps, pooled CI."""
    runs = list(load_maps(out).values())
    lines = []
    for split in runs[0]["per_user"] if runs else []:
        for k in KEYS:
            model, users = _model_rows(runs, split, k, out)
            for b, per in runs[0].get("baseline_per_user", {}).items():
                if split not in per or k not in per[split]:
                    continue
                m, lo, hi = user_boot(model - _aligned(per[split], users, k, f"{b} {split}"), users)
                lines.append(f"{split} {k}: mean over {len(runs)} maps, model - {b} {m:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                             f"(paired by row, {len(users)} rows of {len(set(users))} users)")
    return lines


def against_model(out: str, other: str) -> list[str]:
    """Per map and pooled: the model of OUT minus the model of OTHER on the same rows."""
    a, b = load_maps(out), load_maps(other)
    if not a or sorted(a) != sorted(b):
        sys.exit(f"{out} holds maps {sorted(a)}, {other} holds {sorted(b)}: compare the same maps")
    lines = []
    for split in a[min(a)]["per_user"]:
        if any(split not in r["per_user"] for r in b.values()):
            continue
        for k in KEYS:
            for s in sorted(a):
                users = a[s]["per_user"][split]["user_ids"]
                d = np.asarray(a[s]["per_user"][split][k]) - _aligned(b[s]["per_user"][split], users, k, f"{other} map {s}")
                m, lo, hi = user_boot(d, users)
                lines.append(f"{split} {k} map {s}: {np.mean(a[s]['per_user'][split][k]):.3f} - "
                             f"{np.mean(b[s]['per_user'][split][k]):.3f} = {m:+.3f} [{lo:+.3f}, {hi:+.3f}]")
            ma, users = _model_rows(list(a.values()), split, k, out)
            mb = np.mean([_aligned(r["per_user"][split], users, k, other) for r in b.values()], axis=0)
            m, lo, hi = user_boot(ma - mb, users)
            lines.append(f"{split} {k}: mean over {len(a)} maps {ma.mean():.3f} - {mb.mean():.3f} = "
                         f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}] (paired by row, {len(users)} rows)")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder of maps.sh: OUT/sid<k>/evaluate/metrics.json")
    ap.add_argument("--against", help="another such folder: report OUT's model minus its model")
    args = ap.parse_args(argv)
    print("\n".join(against_model(args.out, args.against) if args.against else against_baselines(args.out)))


if __name__ == "__main__":
    main()
