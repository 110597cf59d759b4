"""bench/quality/pooled.py: figures over several SID maps paired by row, a model against the
baselines or against another model, with user-resampled CIs (pure numpy, no runs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from testkit import load_bench


@pytest.fixture(scope="module")
def pooled():
    return load_bench("quality/pooled")


def _write(out, seed, users, model, base):
    d = out / f"sid{seed}" / "evaluate"
    d.mkdir(parents=True)
    per = lambda xs: {"user_ids": users, "recall@10": xs, "ndcg@10": [x / 2 for x in xs]}  # noqa: E731
    (d / "metrics.json").write_text(json.dumps(
        {"per_user": {"test": per(model)}, "baseline_per_user": {"markov": {"test": per(base)}}}))


def test_user_boot_resamples_users_with_all_their_rows(pooled):
    # One user with 3 rows of +1 and three users with one row of 0 (row mean .5). A draw of 4
    # users holds user a j times: mean 3j / (3j + 4 - j); P(j = 0) = .32 puts the CI's low end at
    # 0, P(j >= 3) = .05 its high end at j = 3's .9. Rows drawn one by one would give neither.
    d = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    m, lo, hi = pooled.user_boot(d, ["a", "a", "a", "b", "c", "d"])
    assert m == pytest.approx(0.5) and lo == 0.0 and hi == pytest.approx(0.9)


def test_a_planted_lift_is_found_per_map_and_pooled(pooled, tmp_path):
    rng = np.random.default_rng(0)
    users = [f"u{i}" for i in range(200)]
    for s in range(3):
        base = (rng.random(200) < 0.2).astype(float).tolist()
        _write(tmp_path / "a", s, users, [1.0 if rng.random() < 0.5 else 0.0 for _ in users], base)
        _write(tmp_path / "b", s, users[::-1], [0.0] * 200, base)  # another row order, same users
    lines = pooled.against_model(str(tmp_path / "a"), str(tmp_path / "b"))
    pooled_line = [ln for ln in lines if ln.startswith("test recall@10: mean over 3 maps")][0]
    lo = float(pooled_line.split("[")[1].split(",")[0])
    assert lo > 0.4, pooled_line  # A recalls ~half the rows, B none
    assert sum(ln.startswith("test recall@10 map ") for ln in lines) == 3
    base_lines = pooled.against_baselines(str(tmp_path / "b"))
    diff = float(base_lines[0].split("model - markov ")[1].split()[0])
    assert base_lines[0].startswith("test recall@10") and -0.25 < diff < -0.15, base_lines  # 0 against ~.2


def test_folders_with_other_maps_or_users_are_refused(pooled, tmp_path):
    _write(tmp_path / "a", 0, ["u1", "u2"], [1.0, 0.0], [0.0, 0.0])
    _write(tmp_path / "b", 1, ["u1", "u2"], [1.0, 0.0], [0.0, 0.0])
    with pytest.raises(SystemExit, match="compare the same maps"):
        pooled.against_model(str(tmp_path / "a"), str(tmp_path / "b"))
    _write(tmp_path / "c", 0, ["u1", "u3"], [1.0, 0.0], [0.0, 0.0])
    with pytest.raises(SystemExit, match="rows are not those of the model"):
        pooled.against_model(str(tmp_path / "a"), str(tmp_path / "c"))
