"""Benchmark: the learnability gate over walks of several sizes and seeds.

For each (items, seed): `gti.data.synth.generate_walk` writes a permutation walk (20 users per
item, 8-14 interactions each), and the real pipeline (`jobs/configs/learnability.yaml`, through
evaluate) trains the small model on it. Printed per walk: test Recall@1/@10 of the model, of
MostPop and of Markov-1, the SFT stage's wall seconds and the pipeline's wall seconds; the
last line is one JSON object with every row and `all_pass` (model Recall@10 >= 0.9 on every
walk). Extra `key=value` overrides go to every run (e.g. `init.method=mean ground.enabled=true`
for the grounded gate, or `sft.prompt_style=chat` to measure the chat prompt).

Usage: python bench/learnability/learnability.py [--quick] [--sizes 30,60,100] [--seeds 1,2] [key=value ...]
One Ray-heavy run at a time: do not run it beside the test suite on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

common.hf_offline(tokenizers=False)

CONFIG = common.CONFIGS / "learnability.yaml"


def one(n_items: int, seed: int, overrides: list[str], work: Path) -> dict:
    from gti import config
    from gti.run import pipeline
    from gti.data import synth

    data = work / f"walk-{n_items}-{seed}"
    synth.generate_walk(n_items, 20 * n_items, data, seed=seed, log=lambda m: None)
    run_dir = work / f"run-{n_items}-{seed}"
    cfg = config.load(CONFIG, [
        f"run_dir={run_dir}", f"seed={seed}", f"data.items.path={data / 'items'}",
        f"data.interactions.path={data / 'interactions'}", *overrides,
    ])
    t0 = time.time()
    done = pipeline.run(cfg, to_stage="evaluate", echo=lambda m: print(m, file=sys.stderr, flush=True))
    wall = time.time() - t0
    m = json.loads((run_dir / "evaluate" / "metrics.json").read_text())
    test, base = m["splits"]["test"], m["baselines"]
    return {
        "items": n_items, "seed": seed,
        "recall@10": test["recall@10"]["value"], "recall@1": test["recall@1"]["value"],
        "mostpop_recall@10": base["mostpop"]["test"]["recall@10"]["value"],
        "markov_recall@10": base["markov"]["test"]["recall@10"]["value"],
        "sft_wall_s": round(done["sft"].duration_s, 1),
        "pipeline_wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one 30-item walk")
    ap.add_argument("--sizes", default="30,60,100")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--workdir", default=None, help="keep runs here (default: a temp dir)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    sizes = [30] if args.quick else [int(x) for x in args.sizes.split(",")]
    seeds = [1] if args.quick else [int(x) for x in args.seeds.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gti-learnability-"))
    rows = []
    for n in sizes:
        for s in seeds:
            r = one(n, s, args.overrides, work)
            print(json.dumps(r), file=sys.stderr, flush=True)
            rows.append(r)
    out = {"rows": rows, "all_pass": all(r["recall@10"] >= 0.9 for r in rows),
           "overrides": args.overrides, "load_avg": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
