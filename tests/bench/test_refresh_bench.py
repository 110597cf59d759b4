"""bench/refresh/refresh.py --quick end to end (tiny model, 300 items, 12 new): the three arms run and
the last line is one JSON object with their figures and wall times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(1500)
def test_refresh_bench_quick(tmp_path):
    """In two parts, as the full mode runs across sessions: `--arms retrain` first, then the
    rest, which reads the retrain arm from the records instead of training it again."""
    cmd = [sys.executable, str(ROOT / "bench" / "refresh" / "refresh.py"), "--quick", "--work", str(tmp_path / "w"),
           "--records", str(tmp_path / "rec")]
    part = subprocess.run(cmd + ["--arms", "retrain"], capture_output=True, text=True, timeout=700, cwd=ROOT)
    assert part.returncode == 0, part.stderr[-3000:]
    first = json.loads(part.stdout.strip().splitlines()[-1])
    assert set(first["arms"]) == {"retrain"} and first["missing_arms"] == ["refresh", "assign_only"]
    recorded = (tmp_path / "rec" / "retrain.new_target.json").read_text()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1450, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "to run: ['refresh', 'assign_only']" in proc.stderr
    assert (tmp_path / "rec" / "retrain.new_target.json").read_text() == recorded
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["missing_arms"] == [] and out["arms"]["retrain"] == first["arms"]["retrain"]
    assert out["bench"] == "refresh" and out["mode"] == "quick" and out["assigned"] == 12
    assert set(out["arms"]) == {"refresh", "assign_only", "retrain"}
    for arm in out["arms"].values():
        assert arm["wall_s"] > 0
        assert arm["new_target"]["n_users"] == out["n_users"]["new_target"] > 0
        r5, mrr = arm["new_target"]["recall@5"], arm["new_target"]["mrr"]
        assert 0 <= r5["ci"][0] <= r5["value"] <= r5["ci"][1] <= 1 and 0 < mrr["ci"][0] <= mrr["value"] <= mrr["ci"][1] <= 1
    for sl in ("new_target", "old_target"):  # MostPop and Markov on the same users, with CIs
        assert set(out["baselines"][sl]) == {"mostpop", "markov"}
        for row in out["baselines"][sl].values():
            # hr@K rides beside recall@K since the time split (fb92f2e): the same figure, the field's name
            assert set(row) == {"recall@1", "recall@5", "hr@1", "hr@5", "mrr"} and row["mrr"]["ci"][0] <= row["mrr"]["value"]
            assert row["hr@5"] == row["recall@5"]
    assert out["arms"]["refresh"]["steps"]["ground"] == 6
    pairs = out["paired"]["new_target"]  # every pair, on the same users (each map holds them all)
    assert set(pairs) == {f"{a}-{b}" for a, b in _bench().PAIRS}
    assert all(d["n_users"] == out["n_users"]["new_target"] for d in pairs.values())
    assert "per_user" not in json.dumps(out)  # the per-user lists stay in the records
    for arm in out["arms"].values():  # the new items' share of every user's top 5, and the overrides
        share = arm["old_target"]["new_share@5"]
        assert 0 <= share["ci"][0] <= share["value"] <= share["ci"][1] <= 1
        assert arm["overrides"] == out["overrides"]
    w = out["overall"]  # every test user: the slices weighted by the new-target share
    assert 0 < w["share_new"] < 1 and set(w["rows"]) == {*out["arms"], "mostpop", "markov"}
    assert set(w["paired"]) == set(pairs)
    for arm, r in out["arms"].items():
        m = w["rows"][arm]["mrr"]
        want = w["share_new"] * r["new_target"]["mrr"]["value"] + (1 - w["share_new"]) * r["old_target"]["mrr"]["value"]
        assert abs(m["value"] - want) < 1e-9 and m["ci"][0] <= m["value"] <= m["ci"][1]


def test_baseline_scores_on_a_toy_catalog():
    """MostPop ranks by training counts, Markov by the last item's successors; MRR uses the
    rank in the whole catalog (after it when the target is not in the catalog)."""
    bench = _bench()
    train = [["a", "b"], ["a", "b"], ["c", "a"]]  # counts a 3, b 2, c 1; a -> b twice, c -> a once
    out = bench.baseline_scores(train, ["a", "b", "c", "d"], [["c"], ["a"], ["a"]], ["a", "b", "zz"], [1, 2],
                                n_boot=50)
    pop, mk = out["mostpop"], out["markov"]
    # MostPop lists a, b, c, d for everyone: targets a (rank 1), b (rank 2), zz (absent: 5)
    assert pop["recall@1"]["value"] == 1 / 3 and pop["recall@2"]["value"] == 2 / 3
    assert abs(pop["mrr"]["value"] - (1 + 1 / 2 + 1 / 5) / 3) < 1e-12
    # Markov: c -> a (rank 1), a -> b (rank 1), zz absent
    assert mk["recall@1"]["value"] == 2 / 3 and abs(mk["mrr"]["value"] - (1 + 1 + 1 / 5) / 3) < 1e-12
    lo, hi = mk["mrr"]["ci"]
    assert lo <= mk["mrr"]["value"] <= hi


def _bench():
    return load_bench("refresh/refresh")


def test_a_resumed_bench_reuses_copies_refreshes_and_scores(tmp_path):
    """--work resumes: an existing linked copy is kept, a finished refresh v1 is read back
    instead of making v2 on top of it, a written score is not recomputed, and the wall time of a
    run comes from its stage manifests."""
    bench = _bench()
    base = tmp_path / "base"
    (base / "sft").mkdir(parents=True)
    (base / "sft" / "_manifest.json").write_text(json.dumps({"duration_s": 30.5}))
    (base / "ground").mkdir()
    (base / "ground" / "_manifest.json").write_text(json.dumps({"duration_s": 10.0}))
    assert bench.stages_wall_s(base) == 40.5
    copy = bench.linked_copy(base, tmp_path / "copy")
    (copy / "refresh" / "v1").mkdir(parents=True)
    facts = {"parent_hash": "p", "new_hash": "n", "total_wall_s": 3.0, "steps": {"ground": 5, "sft": 0}}
    (copy / "refresh" / "v1" / "_manifest.json").write_text(json.dumps({"facts": facts}))
    assert bench.linked_copy(base, tmp_path / "copy") == copy and (copy / "refresh" / "v1").is_dir()
    res = bench.refresh_once(copy, tmp_path / "items.parquet", None, [])  # no refresh runs: no such files
    assert (res.k, res.dir, res.new_hash, res.facts) == (1, copy / "refresh" / "v1", "n", facts)
    calls = []
    first = bench.cached(tmp_path / "scores" / "a.json", lambda: calls.append(1) or {"mrr": 0.5})
    again = bench.cached(tmp_path / "scores" / "a.json", lambda: calls.append(2) or {"mrr": 0.0})
    assert first == again == {"mrr": 0.5} and calls == [1]


def _records(bench, tmp_path, arms=("refresh", "assign_only", "retrain"), inputs=None) -> tuple[Path, Path]:
    """A work folder with the quick mode's data and a records folder holding `arms` finished."""
    work, rec = tmp_path / "w", tmp_path / "rec"
    paths, h = bench.write_data(work, True, 12, 0)
    score = {"n_users": 2, "recall@1": {"value": 0.5, "ci": [0.0, 1.0]}, "mrr": {"value": 0.5, "ci": [0.1, 1.0]}}
    files = {"slices": {"inputs_hash": inputs or bench.inputs_hash(paths["all_inter"], h.new_ids, 40, 0),
                        "baselines": {"new_target": {}, "old_target": {}},
                        "new_target": {"histories": [["a"], ["b"]], "targets": ["c", "d"]},
                        "old_target": {"histories": [["a"], ["b"]], "targets": ["e", "f"]}},
             "base": {"wall_s": 7.0}, "new_item_prior": {sl: score for sl in bench.SLICES},
             "test_share": {"new_target_users": 3, "test_users": 30}}
    for arm in arms:
        files[arm] = {"wall_s": 3.0, "assigned": 12, "sid_map_hash": "h"}
        files.update({f"{arm}.{sl}": score for sl in bench.SLICES})
    rec.mkdir()
    for name, body in files.items():
        (rec / f"{name}.json").write_text(json.dumps(body))
    return work, rec


def _no_training(bench, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("trained although every asked-for arm is recorded")
    monkeypatch.setattr(bench, "run_pipeline", refuse)
    monkeypatch.setattr(bench, "refresh_once", refuse)


def test_recorded_arms_are_read_back_without_training(tmp_path, monkeypatch, capsys):
    """A fresh session with every arm in --records trains nothing and prints the recorded
    figures; with only some recorded and only those asked for, it names the missing ones."""
    bench = _bench()
    _no_training(bench, monkeypatch)
    work, rec = _records(bench, tmp_path)
    assert bench.main(["--quick", "--work", str(work), "--records", str(rec)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["missing_arms"] == [] and out["base_train_wall_s"] == 7.0 and out["assigned"] == 12
    assert out["arms"]["retrain"]["new_target"]["mrr"]["value"] == 0.5 and out["n_users"] == {
        "new_target": 2, "old_target": 2}


def test_a_part_reads_only_its_arms_and_names_the_missing(tmp_path, monkeypatch, capsys):
    bench = _bench()
    _no_training(bench, monkeypatch)
    work, rec = _records(bench, tmp_path, arms=("retrain",))
    assert bench.main(["--quick", "--work", str(work), "--records", str(rec), "--arms", "retrain"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out["arms"]) == {"retrain"} and out["missing_arms"] == ["refresh", "assign_only"]
    with pytest.raises(AssertionError, match="trained although"):  # refresh is not recorded: it would train
        bench.main(["--quick", "--work", str(work), "--records", str(rec), "--arms", "refresh"])


def test_records_of_other_inputs_are_refused_before_training(tmp_path, monkeypatch):
    bench = _bench()
    _no_training(bench, monkeypatch)
    work, rec = _records(bench, tmp_path, inputs="0123456789abcdef")
    with pytest.raises(SystemExit, match="recorded on other inputs .*0123456789abcdef"):
        bench.main(["--quick", "--work", str(work), "--records", str(rec)])
    # another --users changes the inputs too
    work, rec = _records(bench, tmp_path / "b")
    with pytest.raises(SystemExit, match="recorded on other inputs"):
        bench.main(["--quick", "--work", str(work), "--records", str(rec), "--users", "41"])


def test_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--quick", "--arms", "retrain,everything"])
    assert "everything" in capsys.readouterr().err


def test_slices_take_new_target_users_and_an_equal_old_sample(tmp_path):
    """make_slices: the users whose test target is new (history = train items + valid item), as
    many whose target is old, and MostPop/Markov fitted on the training sequences."""
    import polars as pl

    bench = _bench()
    seqs = pl.DataFrame({
        "user_id": ["u1", "u2", "u3", "u4", "u5"],
        "train_items": [["a", "b"], ["b", "c"], ["a", "c"], ["c", "a"], ["b", "a"]],
        "valid_item": ["c", "a", "b", "b", "c"],
        "test_item": ["n1", "a", "n2", "c", "b"],
    })
    path = tmp_path / "sequences.parquet"
    seqs.write_parquet(path)
    out = bench.make_slices(path, ["n1", "n2"], ["a", "b", "c", "n1", "n2"], 10, [1, 5], 0, "h")
    assert out["inputs_hash"] == "h"
    assert out["new_target"] == {"histories": [["a", "b", "c"], ["a", "c", "b"]], "targets": ["n1", "n2"]}
    assert len(out["old_target"]["targets"]) == 2 and set(out["old_target"]["targets"]) <= {"a", "c", "b"}
    for sl in ("new_target", "old_target"):
        assert set(out["baselines"][sl]) == {"mostpop", "markov"}
    # new items never occur in the training sequences: MostPop's top item is an old one
    assert out["baselines"]["new_target"]["mostpop"]["recall@1"]["value"] == 0.0
    assert bench.make_slices(path, ["n1", "n2"], ["a", "b", "c", "n1", "n2"], 1, [1], 0, "h")["new_target"][
        "targets"] == ["n1"]
    # the prior that knows which items are new: MostPop over n1, n2 alone (both unseen in
    # training, so a tie in catalog order): n1 first for everyone
    prior = bench.new_item_prior(path, ["n1", "n2"], out, [1, 2])
    assert prior["new_target"]["recall@2"]["value"] == 1.0 and prior["old_target"]["recall@2"]["value"] == 0.0
    assert "per_user" not in prior["new_target"]


def test_paired_differences_use_the_users_both_arms_scored():
    """paired_diff: a - b per user on the common users (an arm scores only the users its map
    holds), a paired bootstrap CI around it; no per-user values (older records) give {}."""
    bench = _bench()
    a = {"per_user": {"user": [0, 1, 2], "rr": [1.0, 0.5, 0.25], "recall@1": [1.0, 0.0, 0.0]}}
    b = {"per_user": {"user": [1, 2, 3], "rr": [0.25, 0.25, 1.0], "recall@1": [0.0, 1.0, 1.0]}}
    d = bench.paired_diff(a, b, n_boot=200)
    assert d["n_users"] == 2  # users 1 and 2
    assert abs(d["mrr"]["value"] - ((0.5 - 0.25) + 0.0) / 2) < 1e-12 and d["recall@1"]["value"] == -0.5
    lo, hi = d["mrr"]["ci"]
    assert 0.0 <= lo <= d["mrr"]["value"] <= hi <= 0.25
    assert bench.paired_diff(a, {"mrr": {"value": 0.1}}) == {}
    rows = bench.paired_rows({"refresh": {"new_target": a, "old_target": a}, "retrain": {"new_target": b, "old_target": {}}},
                             {"new_target": {"markov": b}})
    assert set(rows["new_target"]) == {"refresh-retrain", "refresh-markov", "retrain-markov"}
    assert rows["old_target"] == {}  # retrain's old_target row has no per-user values


def test_the_markdown_table_lists_arms_baselines_and_pairs():
    bench = _bench()
    cell = {"value": 0.25, "ci": [0.1, 0.4]}
    row = {"n_users": 4, "recall@1": cell, "mrr": cell, "per_user": {"user": [0]}}
    arm_row = {**row, "new_share@1": {"value": 0.5, "ci": [0.25, 0.75]}}
    out = {"ks": [1], "n_users": {"new_target": 4, "old_target": 4},
           "arms": {"refresh": {"wall_s": 812.4, "new_target": arm_row, "old_target": arm_row}},
           "baselines": {"new_target": {"markov": row}, "old_target": {}},
           "paired": {"new_target": {"refresh-markov": {"n_users": 4, "recall@1": cell, "mrr": cell}}}}
    md = bench.markdown_table(out)
    assert "| refresh | 4 | 0.250 [0.100, 0.400] | 0.2500 [0.1000, 0.4000] | 0.500 [0.250, 0.750] | 812 |" in md
    assert "| markov | 4 | 0.250 [0.100, 0.400] | 0.2500 [0.1000, 0.4000] | - | - |" in md
    assert "| refresh-markov | 4 |" in md
    assert md.count("| arm | users | recall@1 | MRR | new_share@1 | wall s |") == 2
    assert bench.without_per_user({"a": row})["a"] == {"n_users": 4, "recall@1": cell, "mrr": cell}


def test_a_variant_refreshes_its_own_copies_and_records_elsewhere(tmp_path, monkeypatch):
    """Overrides beyond the mode's own name other copies of the base run (a variant never reuses
    a refresh done with other settings), and records made with other overrides are refused
    before any training (records without the field, written before it was kept, are read)."""
    bench = _bench()
    mode = bench.QUICK
    assert bench.variant_suffix([*mode["overrides"], "seed=0"], mode) == ""
    a = bench.variant_suffix([*mode["overrides"], "seed=0", "refresh.ground_lr=3e-4"], mode)
    b = bench.variant_suffix([*mode["overrides"], "seed=0", "refresh.ground_lr=1e-4"], mode)
    assert a.startswith("-") and len(a) == 9 and a != b
    _no_training(bench, monkeypatch)
    work, rec = _records(bench, tmp_path)
    body = json.loads((rec / "refresh.json").read_text())
    (rec / "refresh.json").write_text(json.dumps({**body, "overrides": [*mode["overrides"], "seed=0"]}))
    assert bench.main(["--quick", "--work", str(work), "--records", str(rec)]) == 0  # same overrides
    with pytest.raises(SystemExit, match=r"refresh.json was recorded with overrides .*refresh.ground_lr=3e-4"):
        bench.main(["--quick", "--work", str(work), "--records", str(rec), "refresh.ground_lr=3e-4"])


def test_arm_overrides_keep_only_what_can_change_the_arm():
    bench = _bench()
    ov = ["refresh.ground_steps=100", "refresh.on_full_group=add_tokens", "sft.val_mrr=false", "seed=0",
          "refresh.ground_lr=3e-4", "refresh.sft_steps=50", "refresh.replay_ratio=4"]
    assert bench.arm_overrides("refresh", ov) == ov
    assert bench.arm_overrides("retrain", ov) == ["sft.val_mrr=false", "seed=0"]
    assert bench.arm_overrides("assign_only", ov) == ["refresh.on_full_group=add_tokens", "sft.val_mrr=false", "seed=0"]


def test_a_variant_shares_the_baseline_records_and_pairs_with_them(tmp_path, monkeypatch, capsys):
    """--baseline-records copies the users, references and the arms a variant does not compute;
    SIDs only and the retrain, recorded with the mode's overrides, are accepted beside a refresh
    recorded with refresh.ground_lr=3e-4 (it cannot change them), but not under another
    on_full_group (it decides SIDs only's tokens)."""
    bench = _bench()
    mode = bench.QUICK
    _no_training(bench, monkeypatch)
    work, base = _records(bench, tmp_path)
    for arm in bench.ARMS:
        body = json.loads((base / f"{arm}.json").read_text())
        (base / f"{arm}.json").write_text(json.dumps({**body, "overrides": [*mode["overrides"], "seed=0"]}))
    var = tmp_path / "variant"
    var.mkdir()
    for sl in ("", *(f".{s}" for s in bench.SLICES)):  # the variant's own refresh, already scored
        (var / f"refresh{sl}.json").write_text((base / f"refresh{sl}.json").read_text())
    body = json.loads((var / "refresh.json").read_text())
    ov = [*mode["overrides"], "seed=0", "refresh.ground_lr=3e-4"]
    (var / "refresh.json").write_text(json.dumps({**body, "overrides": ov, "wall_s": 9.0}))
    args = ["--quick", "--work", str(work), "--records", str(var), "--arms", "refresh",
            "--baseline-records", str(base), "refresh.ground_lr=3e-4"]
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["missing_arms"] == [] and out["arms"]["refresh"]["wall_s"] == 9.0
    assert out["arms"]["retrain"]["wall_s"] == 3.0 and out["test_share"] == {"new_target_users": 3, "test_users": 30}
    assert {"slices", "assign_only", "retrain.old_target", "test_share"} <= {p.stem for p in var.glob("*.json")}
    # the variant's refresh is not overwritten by the baseline's
    assert json.loads((var / "refresh.json").read_text())["wall_s"] == 9.0
    with pytest.raises(SystemExit, match=r"assign_only.json was recorded with overrides"):
        bench.main([*args[:4], str(tmp_path / "variant2"), *args[5:-1], "refresh.on_full_group=error"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main([*args[:7], "--baseline-records", str(tmp_path / "nowhere")])
    assert "nowhere/slices.json not found (not a records folder)" in capsys.readouterr().err


def test_overall_weights_the_slices_by_the_new_target_share():
    """overall: share * new + (1 - share) * old per arm and baseline, each slice resampled on its
    own; paired rows on the users both scored per slice; rows without per-user values skipped."""
    bench = _bench()

    def row(users, rr):
        return {"per_user": {"user": users, "rr": rr, "recall@1": [float(r == 1.0) for r in rr]}}
    arms = {"refresh": {"new_target": row([0, 1], [1.0, 0.5]), "old_target": row([0, 1], [0.25, 0.25])},
            "assign_only": {"new_target": row([0, 1], [0.5, 0.5]), "old_target": row([0, 1], [0.5, 0.5])},
            "retrain": {"new_target": {"mrr": {"value": 0.3}}, "old_target": {"mrr": {"value": 0.3}}}}
    baselines = {"new_target": {"markov": row([0, 1], [0.5, 0.5])}, "old_target": {"markov": row([1], [1.0])}}
    w = bench.overall(arms, baselines, {"new_target_users": 1, "test_users": 4}, n_boot=200)
    assert w["share_new"] == 0.25 and set(w["rows"]) == {"refresh", "assign_only", "markov"}
    assert abs(w["rows"]["refresh"]["mrr"]["value"] - (0.25 * 0.75 + 0.75 * 0.25)) < 1e-12
    assert w["rows"]["assign_only"]["mrr"] == {"value": 0.5, "ci": [0.5, 0.5]}
    assert w["rows"]["refresh"]["recall@1"]["value"] == 0.25 * 0.5
    d = w["paired"]["refresh-assign_only"]["mrr"]
    assert abs(d["value"] - (0.25 * 0.25 + 0.75 * -0.25)) < 1e-12 and d["ci"][0] <= d["value"] <= d["ci"][1]
    # refresh - markov: old slice on user 1 only (0.25 - 1.0)
    assert abs(w["paired"]["refresh-markov"]["mrr"]["value"] - (0.25 * 0.25 + 0.75 * -0.75)) < 1e-12
    assert "refresh-retrain" not in w["paired"]  # the retrain rows have no per-user values
    out = {"ks": [1], "n_users": {"new_target": 2, "old_target": 2}, "arms": {}, "baselines": {}, "overall": w}
    md = bench.markdown_table(out)
    assert "all test users (weighted: 25.0% have a new target" in md and "| refresh-assign_only | " in md
