"""Benchmark: plain residual k-means of this checkout against an earlier commit's, same data.

Run:  python bench/sid/plain_ab.py --base ddcb28b    (both bench sets, seeds 0-2, ~3 min)

`gti.sid.kmeans` of this checkout and of `--base` (read with `git show`, imported as its own
module) fit plain residual k-means (k-means++ seeds, exactly 25 Lloyd steps per level, 4 x 256)
on the same 65,536-row sample of each `bench/sid/sid.py` set, the two fits interleaved, the
order alternating per seed (paired differences new - base with a normal
95% interval over the seeds); every item is then encoded by its nearest code per level (this
checkout's `nearest` for both, so only the fit differs). Per side and seed: fit seconds,
reconstruction MSE per element, collision rate of the codes, utilisation per level; then the
means and `fit_new_over_base`. One torch / BLAS thread.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sid as bench  # noqa: E402  (bench/sid/sid.py: the data sets, figures, LEVELS, K)

from gti.sid.kmeans import nearest  # noqa: E402


def base_kmeans(ref: str):
    """gti.sid.kmeans as it was at git ref `ref`, as a module of its own."""
    src = subprocess.run(["git", "show", f"{ref}:platform/gti/sid/kmeans.py"], check=True,
                         capture_output=True, text=True, cwd=bench.common.ROOT).stdout
    path = Path(tempfile.mkdtemp()) / "kmeans_base.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("kmeans_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kmeans_base"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def fit(kmeans_fn, sample: torch.Tensor, seed: int) -> tuple[list, float]:
    """Plain residual k-means as `bench/sid/sid.py`'s `fit_plain` runs it -> (codebooks, s)."""
    gen = torch.Generator().manual_seed(seed)
    res, books = sample.clone(), []
    t0 = time.perf_counter()
    for _ in range(bench.LEVELS):
        km = kmeans_fn(res, bench.K, iters=25, generator=gen, tol=float("-inf"))
        books.append(km.centroids)
        res = res - km.centroids[km.assign]
    return books, time.perf_counter() - t0


def quality(x: np.ndarray, books: list) -> dict:
    r, codes = torch.from_numpy(x), []
    for cb in books:
        codes.append(nearest(r, cb)[0])
        r = r - cb[codes[-1]]
    codes = torch.stack(codes, 1).numpy()
    recon = sum(books[lv][torch.from_numpy(codes[:, lv])] for lv in range(bench.LEVELS)).numpy()
    f = bench.figures(x, codes, recon, 0.0, 0.0)
    return {k: f[k] for k in ("recon_mse", "collision_rate", "utilisation")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git ref whose gti.sid.kmeans is the baseline")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--sets", default="minilm,synthetic", help="comma-separated: minilm, synthetic")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
    import gti.sid.kmeans as new

    sides = {"new": new.kmeans, "base": base_kmeans(args.base).kmeans}
    out: dict = {"bench": "sid_plain_ab", "base": args.base, "sets": {}}
    loaders = {"minilm": lambda: bench.minilm_embeddings(None),
               "synthetic": lambda: bench.synthetic_embeddings(1_000_000)}
    for name in args.sets.split(","):
        x = loaders[name]()
        xt = torch.from_numpy(x)
        sample = xt[torch.randperm(len(xt), generator=torch.Generator().manual_seed(0))[:65536]].contiguous()
        rows: dict[str, list] = {"new": [], "base": []}
        for seed in range(args.seeds):
            for side in (["new", "base"] if seed % 2 == 0 else ["base", "new"]):
                books, secs = fit(sides[side], sample, seed)
                rows[side].append({"seed": seed, "fit_s": round(secs, 2), **quality(x, books)})
                print(f"{name} {side:4s} " + json.dumps(rows[side][-1]), flush=True)
        keys = ("fit_s", "recon_mse", "collision_rate")
        mean = {side: {k: float(np.mean([r[k] for r in rs])) for k in keys} for side, rs in rows.items()}
        # Paired by seed: new - base, mean and a 95% t-interval (the seeds are the replicates).
        diff = {}
        for k in ("recon_mse", "collision_rate"):
            d = np.array([a[k] - b[k] for a, b in zip(rows["new"], rows["base"])])
            half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
            diff[k] = [float(d.mean()), float(d.mean() - half), float(d.mean() + half)]
        out["sets"][name] = {"items": len(x), "rows": rows, "mean": mean, "new_minus_base": diff,
                             "fit_new_over_base": round(mean["new"]["fit_s"] / mean["base"]["fit_s"], 3)}
        print(f"{name}: mean {json.dumps(mean)} new-base {json.dumps(diff)}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
