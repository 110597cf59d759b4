"""gti.eval.tables: the metrics table (with the cold slice's rows) and the rank-metrics line."""

from __future__ import annotations

from gti.eval.tables import format_ranks, format_table

KS = [1, 2]


def _metrics(cold_valid: dict, cold_test: dict) -> dict:
    cell = {"value": 0.5, "ci": [0.4, 0.6]}
    table = {f"{m}@{k}": cell for m in ("recall", "ndcg", "precision") for k in KS}
    return {
        "splits": {"valid": table, "test": table},
        "baselines": {"mostpop": {"valid": table, "test": table}, "markov": {"valid": table, "test": table}},
        "invalid_sid_rate": 0.0,
        "n_users": {"valid": 4, "test": 4},
        "slices": {"cold": {"definition": {"max_sft_targets": 1, "n_cold_items": 4},
                            "valid": cold_valid, "test": cold_test}},
    }


def test_format_table_has_cold_rows_and_skips_empty_slices():
    cell = {"value": 0.25, "ci": [0.0, 0.5]}
    table = {f"{m}@{k}": cell for m in ("recall", "ndcg", "precision") for k in KS}
    cold = {"n_users": 3, "model": table, "baselines": {"mostpop": table, "markov": table}, "ranks": {}}
    empty = {"n_users": 0, "model": {}, "baselines": {"mostpop": {}, "markov": {}}, "ranks": {}}
    text = format_table(_metrics(cold, empty), KS)
    names = [line.split()[0] for line in text.splitlines()[1:] if line and "/" in line.split()[0]]
    assert names == ["valid/sft", "valid/mostpop", "valid/markov", "test/sft", "test/mostpop", "test/markov",
                     "valid/sft[cold]", "valid/mostpop[cold]", "valid/markov[cold]"]
    assert "cold users (target of <= 1 SFT windows, 4 cold items): valid=3, test=0" in text
    # A metrics dict without slices (older runs) still formats.
    old = _metrics(cold, empty)
    del old["slices"]
    assert "[cold]" not in format_table(old, KS) and "cold users" not in format_table(old, KS)


def test_format_ranks_line():
    from gti.eval.rank import rank_metrics

    line = format_ranks("test", rank_metrics([1.0, 2.0, 4.0], 5, 0, 0), "[cold]")
    assert line.startswith("test[cold]: MRR 0.5833 [0.5833, 0.5833]")
    assert "mean percentile rank 0.3333" in line and "median rank 2 of 5 items (3 users)" in line
