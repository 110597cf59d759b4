"""What Ray Data's pools cost a small catalog: the stages before training (ingest -> embed ->
sid -> pairs) with `local_max_items` at its default (a catalog this small runs in the driver)
and at 0 (Ray Data read tasks and actor pools, as for a large catalog), interleaved: A B, A B,
... `--rounds` times, each a fresh `gti run` process with its own local Ray.

Config: `jobs/configs/demo.yaml` (the demo's dense subset of the bundled data, 1,000 items,
MiniLM, RQ-VAE 3 x 32; `--config` for another), `--to pairs`. The RQ-VAE is trained in both
arms (Ray Train either way). Per arm and stage the median of the stage's wall seconds (from its
manifest), and of the whole command; both arms' tables must be equal (the script checks the
content hashes of every output table: the key changes where work runs, never what it makes).

    python bench/small_catalog/small_catalog.py            # 2 rounds, demo.yaml
    python bench/small_catalog/small_catalog.py --quick    # 1 round, tiny.yaml

Last line: JSON with `<arm>_<stage>_s`, `<arm>_total_s`, `local_over_ray_<stage>` (below 1 =
faster in the driver), `same_outputs` and the load average. Record figures in bench/small_catalog/RESULTS.md
with the machine's load (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared module
import common  # noqa: E402

STAGES = ("ingest", "embed", "sid", "pairs")
ARMS = {"local": [], "ray": ["local_max_items=0"]}


def run_arm(config: Path, run_dir: Path, overrides: list[str]) -> tuple[float, dict[str, float]]:
    """One `gti run --to pairs` in a fresh process; -> (command seconds, stage -> seconds)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "gti", "run", "--config", str(config), f"run_dir={run_dir}",
                        *overrides, "--to", "pairs"], capture_output=True, text=True, cwd=common.ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"gti run failed ({overrides}):\n{p.stderr[-3000:]}")
    stages = {s: json.loads((run_dir / s / "_manifest.json").read_text())["duration_s"] for s in STAGES}
    return wall, stages


def output_hashes(run_dir: Path) -> dict[str, str]:
    """Content hash of every table the stages wrote (order-free, as compare's records use)."""
    from gti.experiments.records import table_hash

    return {f"{s}/{f.name}": table_hash(f) for s in STAGES for f in sorted((run_dir / s).glob("*.parquet"))}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 round on tiny.yaml")
    a = ap.parse_args(argv)
    config = a.config or common.CONFIGS / ("tiny.yaml" if a.quick else "demo.yaml")
    rounds = 1 if a.quick else a.rounds
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    common.hf_offline()
    load0 = os.getloadavg()[0]
    walls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    stage_s: dict[str, dict[str, list[float]]] = {arm: {s: [] for s in STAGES} for arm in ARMS}
    hashes: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for arm, overrides in ARMS.items():
                run_dir = Path(tmp) / f"{arm}-{r}"
                wall, stages = run_arm(config, run_dir, overrides)
                walls[arm].append(wall)
                for s, v in stages.items():
                    stage_s[arm][s].append(v)
                hashes.setdefault(arm, output_hashes(run_dir))
                shutil.rmtree(run_dir)
                common.log(f"round {r + 1} {arm}: {wall:.1f} s; " + ", ".join(f"{s} {v:.1f}" for s, v in stages.items()))
    out: dict = {"bench": "small_catalog", "config": str(config.relative_to(common.ROOT)), "rounds": rounds,
                 "load_avg_1m_start": round(load0, 2), "load_avg_1m_end": round(os.getloadavg()[0], 2)}
    for arm in ARMS:
        out[f"{arm}_total_s"] = round(statistics.median(walls[arm]), 2)
        for s in STAGES:
            out[f"{arm}_{s}_s"] = round(statistics.median(stage_s[arm][s]), 2)
    for s in STAGES:
        out[f"local_over_ray_{s}"] = round(out[f"local_{s}_s"] / max(out[f"ray_{s}_s"], 1e-9), 3)
    out["local_over_ray_total"] = round(out["local_total_s"] / out["ray_total_s"], 3)
    out["same_outputs"] = hashes["local"] == hashes["ray"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
