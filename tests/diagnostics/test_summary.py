"""gti.diagnostics.summary: the end-of-run summary on a synthetic run folder (metrics.json,
recs.parquet, ingest's items and sequences, stage manifests; no model, no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from gti import cli
from gti.diagnostics import summary as S

STAGES = ["ingest", "embed", "sid", "pairs", "ground", "sft", "evaluate", "report"]


def _entry(v: float, lo: float, hi: float) -> dict:
    return {"value": v, "ci": [lo, hi]}


def _table(r5: float, r10: float, n10: float) -> dict:
    return {"recall@5": _entry(r5, r5 / 2, r5 * 2), "recall@10": _entry(r10, r10 / 2, r10 * 2),
            "ndcg@5": _entry(n10 / 2, 0, n10), "ndcg@10": _entry(n10, n10 / 2, n10 * 2)}


def _ranks(mrr: float) -> dict:
    return {"mrr": _entry(mrr, mrr - 0.01, mrr + 0.01), "mean_percentile_rank": _entry(0.2, 0.1, 0.3),
            "median_rank": 40.0, "n_items": 1000, "n_users": 3}


def _metrics(exact_rank: bool = True) -> dict:
    m = {
        "splits": {"valid": _table(0.1, 0.2, 0.1), "test": _table(0.12, 0.18, 0.09)},
        "baselines": {"mostpop": {"test": _table(0.02, 0.03, 0.015)}, "markov": {"test": _table(0.05, 0.08, 0.04)},
                      "sasrec": {"test": _table(0.1, 0.16, 0.08)}},
        "ranks": {}, "baseline_ranks": {}, "n_users": {"valid": 3, "test": 3},
        "per_user": {"test": {"user_ids": ["u7", "u8", "u9"]}},
        "config": {"ks": [5, 10], "exact_rank": exact_rank},
    }
    if exact_rank:
        m["ranks"] = {"test": _ranks(0.061)}
        m["baseline_ranks"] = {"sasrec": {"test": _ranks(0.052)}}
        m["per_user"]["test"]["exact_rank"] = [57.0, 1.0, 3.0]
    return m


MISS = ["i5", "i1", "i2", "i3", "i4", "i6"]  # the model's list for u7, whose true next item is i9


def _run(tmp_path: Path, exact_rank: bool = True, top: list[str] = MISS) -> Path:
    """A run folder with what the summary reads; the sample user is u7 (the first test row)."""
    run = tmp_path / "runs" / "demo"
    for i, stage in enumerate(STAGES[:-1]):  # no report stage yet
        (run / stage).mkdir(parents=True)
        (run / stage / "_manifest.json").write_text(json.dumps({"stage": stage, "duration_s": 10.0 + 100 * i}))
    (run / "evaluate" / "metrics.json").write_text(json.dumps(_metrics(exact_rank)))
    pl.DataFrame({"user_id": ["u1", "u7", "u8"], "split": ["valid", "test", "test"], "target": ["i2", "i9", "i1"],
                  "items": [["i1"], top, ["i1"]], "scores": [[0.0], [0.0] * len(top), [0.0]]}).write_parquet(
        run / "evaluate" / "recs.parquet")
    pl.DataFrame({"item_id": [f"i{i}" for i in range(10)],
                  "title": [f"Beaker {i}" if i != 4 else None for i in range(10)]}).write_parquet(
        run / "ingest" / "items.parquet")
    pl.DataFrame({"user_id": ["u7", "u1"], "train_items": [["i0", "i1", "i2", "i3"], ["i1"]],
                  "valid_item": ["i8", "i2"], "test_item": ["i9", "i3"]}).write_parquet(
        run / "ingest" / "sequences.parquet")
    return run


def test_one_table_model_sasrec_markov_mostpop_with_cis_and_mrr(tmp_path):
    s = S.read_run(_run(tmp_path), STAGES, shown="runs/demo", config="jobs/configs/demo.yaml")
    text = S.format_summary(s)
    lines = text.splitlines()
    assert lines[0].startswith("Run runs/demo: test split, 3 users, the same users in every row")
    header = next(ln for ln in lines if "Recall@5" in ln)
    assert header.split() == ["Recall@5", "Recall@10", "NDCG@10", "MRR"]
    rows = lines[lines.index(header) + 1: lines.index(header) + 5]
    assert [r.split("  ")[0].strip() for r in rows] == ["gti (SFT model)", "SASRec", "Markov-1", "MostPop"]
    # The test split's values with their CIs, in column order; MRR where exact ranks exist.
    assert rows[0].split()[3:] == ["0.120", "[0.060,", "0.240]", "0.180", "[0.090,", "0.360]", "0.090",
                                   "[0.045,", "0.180]", "0.061", "[0.051,", "0.071]"]
    assert "0.052 [0.042, 0.062]" in rows[1] and rows[2].rstrip().endswith("-") and rows[3].rstrip().endswith("-")
    assert "0.020 [0.010, 0.040]" in rows[3]  # MostPop's Recall@5
    assert any(ln.startswith("MRR: from the true item's exact rank among all 1,000 catalog items") for ln in lines)


def test_tuned_sasrec_label_and_paired_difference_rows(tmp_path):
    """metrics.json's "reference".sasrec.label names the SASRec row; "paired" gives the rows
    gti - SASRec / gti - Markov-1 / gti - MostPop (signed, with the paired CI), '-' where a
    column has no paired value (Markov's exact MRR: it ranks only its top K)."""
    m = _metrics(exact_rank=True)
    m["reference"] = {"sasrec": {"label": "SASRec (tuned on valid)", "sweep": {"chosen": {"max_len": 20}}}}
    cell = lambda v: {"value": v, "ci": [v - 0.02, v + 0.01], "n_users": 3}  # noqa: E731
    m["paired"] = {"test": {
        "sasrec": {"recall@5": cell(0.02), "recall@10": cell(-0.063), "ndcg@10": cell(0.01), "mrr": cell(0.009)},
        "markov": {"recall@5": cell(0.07), "recall@10": cell(0.1), "ndcg@10": cell(-0.033), "mrr@10": cell(0.2)},
        "mostpop": {"recall@10": cell(0.15)}}}
    run = _run(tmp_path)
    (run / "evaluate" / "metrics.json").write_text(json.dumps(m))
    lines = S.format_summary(S.read_run(run, STAGES)).splitlines()
    header = next(ln for ln in lines if "Recall@5" in ln)
    rows = [ln.split("  ")[0].strip() for ln in lines[lines.index(header) + 1: lines.index(header) + 8]]
    assert rows == ["gti (SFT model)", "SASRec (tuned on valid)", "Markov-1", "MostPop", "gti - SASRec",
                    "gti - Markov-1", "gti - MostPop"]
    table = dict(S.table_rows(m, "test"))
    assert table["gti - SASRec"] == ["+0.020 [+0.000, +0.030]", "-0.063 [-0.083, -0.053]",
                                     "+0.010 [-0.010, +0.020]", "+0.009 [-0.011, +0.019]"]
    assert table["gti - Markov-1"][2] == "-0.033 [-0.053, -0.023]" and table["gti - Markov-1"][3] == "-"
    assert table["gti - MostPop"] == ["-", "+0.150 [+0.130, +0.160]", "-", "-"]
    assert any(ln.startswith("gti - X: the model minus row X user by user") for ln in lines)
    # Without the reference block (an older metrics.json, or the sweep off) the row is "SASRec".
    assert "SASRec" in dict(S.table_rows(_metrics(), "test")) and S.row_name({}, "markov") == "Markov-1"


def test_the_sample_user_with_titles_beside_the_true_next_item(tmp_path):
    text = S.format_summary(S.read_run(_run(tmp_path), STAGES, shown="runs/demo"))
    lines = text.splitlines()
    start = lines.index("A test user (u7, 5 items before the one to predict):")
    assert lines[start + 1: start + 5] == ["  history, last 3 (oldest first):", "       i2  Beaker 2",
                                           "       i3  Beaker 3", "       i8  Beaker 8"]
    assert lines[start + 5] == "  true next item:   i9  Beaker 9"
    assert lines[start + 7: start + 12] == ["     1. i5  Beaker 5", "     2. i1  Beaker 1", "     3. i2  Beaker 2",
                                            "     4. i3  Beaker 3", "     5. i4  (no title)"]
    # Not in the model's list: where it ranked over the catalog, from per_user exact ranks.
    assert lines[start + 12] == "  (the true item is not in the model's top 6; its exact rank over the catalog: 57)"


def test_a_hit_is_marked_and_no_exact_rank_is_said_plainly(tmp_path):
    text = S.format_summary(S.read_run(_run(tmp_path, exact_rank=False, top=["i5", "i9", "i2", "i3", "i4"]), STAGES))
    assert "     2. i9  Beaker 9   <- the true next item" in text.splitlines()
    assert "the true item is" not in text
    # Without exact ranks: MRR@10 of each row's top 10 where per-user NDCG@10 is there, '-' where not.
    assert "MRR@10: 1/rank of the true item in each row's top 10 (0 when absent)" in text
    assert next(ln for ln in text.splitlines() if ln.strip().startswith("Recall@5")).split()[-1] == "MRR@10"
    model_row = next(ln for ln in text.splitlines() if ln.startswith("gti (SFT model)"))
    assert model_row.rstrip().endswith("-")  # this metrics.json has no per-user NDCG@10
    import math

    m = _metrics(exact_rank=False)
    # Three users: a hit at rank 1, at rank 3, a miss: MRR@10 = (1 + 1/3 + 0) / 3.
    m["per_user"]["test"]["ndcg@10"] = [1.0, 1 / math.log2(4), 0.0]
    m["baseline_per_user"] = {"markov": {"test": {"user_ids": ["u7", "u8", "u9"], "ndcg@10": [0.0, 0.0, 1.0]}}}
    rows = dict(S.table_rows(m, "test"))
    assert rows["gti (SFT model)"][-1].startswith(f"{(1 + 1 / 3) / 3:.3f} [")
    assert rows["Markov-1"][-1].startswith("0.333 [") and rows["MostPop"][-1] == "-"


def test_mrr_at_k_from_per_user_ndcg():
    import math

    got = S.mrr_at_k([1.0, 1 / math.log2(3), 1 / math.log2(11), 0.0], n_boot=200)
    assert got["value"] == pytest.approx((1 + 1 / 2 + 1 / 10 + 0) / 4)
    lo, hi = got["ci"]
    assert lo <= got["value"] <= hi and hi > lo
    assert S.mrr_at_k(None, 200) is None
    # Several rows per user: the CI resamples users (a user's rows move together). 20 users of 4
    # rows each, every row of a user a hit or every one a miss: 20 units, a wider CI than 80.
    ndcg = [float(u % 2) for u in range(20) for _ in range(4)]
    rows_apart = S.mrr_at_k(ndcg, n_boot=400)["ci"]
    by_user = S.mrr_at_k(ndcg, n_boot=400, user_ids=[f"u{u}" for u in range(20) for _ in range(4)])["ci"]
    assert by_user[1] - by_user[0] > rows_apart[1] - rows_apart[0]


def test_a_true_item_below_the_shown_five_says_where_and_none_says_so(tmp_path):
    later = S.format_summary(S.read_run(_run(tmp_path / "a", top=["i5", "i1", "i2", "i3", "i4", "i9"]), STAGES))
    assert "  (the true item is number 6 of the model's top 6)" in later.splitlines()
    absent = S.format_summary(S.read_run(_run(tmp_path / "b", exact_rank=False), STAGES))
    assert "  (the true item is not in the model's top 6)" in absent.splitlines()


def test_wall_time_per_stage_and_the_next_commands(tmp_path):
    run = _run(tmp_path)
    text = S.format_summary(S.read_run(run, STAGES, shown="runs/demo", config="jobs/configs/demo.yaml"))
    assert ("Wall time per stage: ingest 10.0 s, embed 110.0 s, sid 3.5 min, pairs 5.2 min, ground 6.8 min, "
            "sft 8.5 min, evaluate 10.2 min; total 36.2 min") in text
    nxt = text.splitlines()[text.splitlines().index("Next:") + 1:]
    assert [ln.split("#")[0].strip() for ln in nxt] == [
        "gti stage report --config jobs/configs/demo.yaml",
        "gti recommend --run-dir runs/demo --history i2,i3,i8 --k 10",
        "gti serve --run-dir runs/demo",
        "gti infer --run-dir runs/demo --users all --k 10 --out runs/demo/infer",
    ]
    (run / "report").mkdir()
    (run / "report" / "report.html").write_text("<html/>")
    again = S.format_summary(S.read_run(run, STAGES, shown="runs/demo"))
    assert f"open {run / 'report' / 'report.html'}" in again


def test_columns_follow_eval_ks():
    assert S.summary_columns([5, 10, 20]) == ["recall@5", "recall@10", "ndcg@10"]
    assert S.summary_columns([1, 5]) == ["recall@5", "ndcg@5"]
    assert S.summary_columns([20]) == ["recall@20", "ndcg@20"]
    assert S.summary_columns([3, 5, 10]) == ["recall@3", "recall@5", "recall@10", "ndcg@10"]


def test_several_rows_per_user_say_hr_and_count_the_rows(tmp_path):
    """The global time split (more rows than users): the field's names, HR@3/5/10, the row
    count in the title; leave-one-out (one row per user) keeps Recall@K."""
    m = _metrics()
    m["config"]["ks"] = [3, 5, 10]
    for table in [m["splits"]["test"], *(b["test"] for b in m["baselines"].values())]:
        table["recall@3"] = _entry(0.01, 0.0, 0.02)
        table.update({k.replace("recall", "hr"): dict(v) for k, v in list(table.items()) if k.startswith("recall")})
    m["n_rows"] = {"test": 1668}
    m["n_users"]["test"] = 519
    run = _run(tmp_path)
    (run / "evaluate" / "metrics.json").write_text(json.dumps(m))
    lines = S.format_summary(S.read_run(run, STAGES, shown="runs/t")).splitlines()
    assert lines[0].startswith("Run runs/t: test split, 519 users (1,668 rows), the same users")
    assert next(ln for ln in lines if "HR@3" in ln).split() == ["HR@3", "HR@5", "HR@10", "NDCG@10", "MRR"]
    m["n_rows"]["test"] = 519  # one row per user: Recall, and no row count
    (run / "evaluate" / "metrics.json").write_text(json.dumps(m))
    lines = S.format_summary(S.read_run(run, STAGES, shown="runs/t")).splitlines()
    assert lines[0].startswith("Run runs/t: test split, 519 users, the same users")
    assert next(ln for ln in lines if "Recall@3" in ln).split() == ["Recall@3", "Recall@5", "Recall@10", "NDCG@10",
                                                                   "MRR"]


def test_a_missing_sample_file_drops_the_sample_not_the_table(tmp_path):
    run = _run(tmp_path)
    (run / "evaluate" / "recs.parquet").unlink()
    s = S.read_run(run, STAGES)
    assert s.sample is None
    text = S.format_summary(s)
    assert "SASRec" in text and "A test user" not in text and "--history '<id>,<id>,<id>'" in text


def test_gti_run_prints_it_when_the_evaluation_is_complete(tmp_path, monkeypatch, capsys):
    from gti.run import pipeline

    run = _run(tmp_path)
    conf = tmp_path / "c.yaml"
    conf.write_text(f"run_dir: {run}\n")
    monkeypatch.setattr(pipeline, "run", lambda cfg, **kw: {"evaluate": object()})
    assert cli.main(["run", "-c", str(conf), "--no-preflight"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Run {run}: test split") and "SASRec" in out and "true next item:   i9  Beaker 9" in out
    monkeypatch.setattr(pipeline, "run", lambda cfg, **kw: {"ingest": object()})  # stopped before evaluate
    assert cli.main(["run", "-c", str(conf), "--no-preflight"]) == 0
    assert capsys.readouterr().out == ""


def test_gti_summary_reprints_it_and_names_a_run_without_evaluation(tmp_path, capsys):
    run = _run(tmp_path)
    assert cli.main(["summary", "--run-dir", str(run)]) == 0
    assert S.format_summary(S.read_run(run, STAGES, shown=str(run))) in capsys.readouterr().out
    assert cli.main(["summary", "--run-dir", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gti: error: ") and "no finished evaluate stage" in err and "\n" not in err


@pytest.mark.parametrize("broken", ["{not json", ""])
def test_an_unreadable_metrics_file_is_one_line(tmp_path, capsys, broken):
    run = _run(tmp_path)
    (run / "evaluate" / "metrics.json").write_text(broken)
    assert cli.main(["summary", "--run-dir", str(run)]) == 2
    assert "no summary" in capsys.readouterr().err


def test_what_grounding_did_is_one_line_and_absent_facts_print_nothing(tmp_path):
    run = _run(tmp_path)
    text = S.format_summary(S.read_run(run, STAGES))
    assert "Grounding:" not in text  # a ground manifest without the rows fact (older runs)
    facts = {"grounded": True, "steps_done": 40, "new_token_ids": [100, 206], "init_method": "mean",
             "rows": {"moved_mean": 0.4213, "moved_max": 0.9, "moved_rel": 0.8512,
                      "effective_rank_before": 1.0, "effective_rank_after": 59.71}}
    (run / "ground" / "_manifest.json").write_text(json.dumps({"stage": "ground", "duration_s": 410.0, "facts": facts}))
    text = S.format_summary(S.read_run(run, STAGES))
    assert ("Grounding: 40 steps moved the 106 new rows 0.421 on average (0.85x an old row's norm); "
            "their effective rank 1.0 -> 59.7 (1.0 = all rows equal)") in text.splitlines()
    off = dict(facts, grounded=False, rows=dict(facts["rows"], moved_mean=0.0, effective_rank_after=1.0))
    assert S.format_grounding(off) == "Grounding: off (mean init only); new rows' effective rank 1.0 -> 1.0"


def test_what_rl_did_names_the_kept_model_and_the_table_row(tmp_path):
    run = _run(tmp_path)
    text = S.format_summary(S.read_run(run, STAGES))
    assert "gti (SFT model)" in text and "RL:" not in text  # no rl stage (older runs)
    (run / "rl").mkdir()
    (run / "rl" / "_manifest.json").write_text(json.dumps({"stage": "rl", "facts": {"enabled": False}}))
    assert "RL:" not in S.format_summary(S.read_run(run, STAGES))  # rl off
    facts = {"enabled": True, "steps_done": 40, "stopped_at": None, "step_stats": {"reward_mean": 0.0674},
             "best": {"metric": "val_mrr", "start": 0.0412, "value": 0.0412, "step": 0}}
    (run / "rl" / "_manifest.json").write_text(json.dumps({"stage": "rl", "facts": facts}))
    text = S.format_summary(S.read_run(run, STAGES))
    assert "gti (RL model)" in text and "gti (SFT model)" not in text
    assert ("RL: 40 GRPO steps; validation mrr 0.041 (SFT model) -> best 0.041: the SFT model was kept "
            "(no step beat it); mean reward 0.067") in text.splitlines()
    moved = dict(facts, stopped_at=20, best={"metric": "val_mrr", "start": 0.04, "value": 0.05, "step": 10})
    assert S.format_rl(moved) == ("RL: 40 GRPO steps; validation mrr 0.040 (SFT model) -> best 0.050: the model "
                                  "of step 10 was kept; stopped early at step 20; mean reward 0.067")
