"""Tests of gti/diagnostics/page.py: the HTML cells, tables and sections of the report page."""

from __future__ import annotations

import base64

from gti.diagnostics import page as H

ROW = {"arm": "gti", "group": "test", "name": "recall@10", "mean": 0.125, "std": 0.01, "ci_lo": 0.1,
       "ci_hi": 0.15, "lift": 0.25, "lift_ci_lo": 0.1, "lift_ci_hi": 0.4, "verdict": "better"}


def test_metric_cell_carries_exact_numbers_and_colours_the_verdict():
    cell = H._metric_cell(ROW)
    assert cell.startswith('<td class="num" data-arm="gti" data-group="test" data-name="recall@10" '
                           'data-mean="0.125" data-std="0.01" data-ci-lo="0.1" data-ci-hi="0.15" data-lift="0.25">')
    assert "0.125 &plusmn; 0.01" in cell and '<span class="ci">[0.1, 0.15]</span>' in cell
    assert '<span class="lift good" title="better">+25.0% [+10.0%, +40.0%]</span>' in cell
    worse = H._metric_cell({**ROW, "lift": -0.2, "verdict": "worse (no CI)", "lift_ci_lo": None, "std": None})
    assert '<span class="lift bad" title="worse (no CI)">-20.0%</span>' in worse and "&plusmn;" not in worse
    plain = H._metric_cell({"arm": "mean", "group": "test", "name": "x<y", "mean": None})
    assert 'data-name="x&lt;y"' in plain and 'data-mean=""' in plain and ">&ndash;</td>" in plain


def test_table_pivots_rows_into_arms_by_columns():
    rows = [dict(ROW, arm=a, name=n, mean=m) for a, n, m in
            [("mean", "recall@10", 0.1), ("mean", "mrr", 0.2), ("gti", "mean_percentile_rank", 0.3)]]
    t = H._table_html(rows, lambda r: r["arm"], lambda r: r["name"], ["arm"], "metrics", H._col_label)
    assert t.startswith('<table class="metrics"><thead><tr><th>arm</th><th>recall@10</th><th>mrr</th>')
    assert '<th>mean_percentile_rank <span title="lower is better">&darr;</span></th>' in t
    assert t.split("<tbody>")[1].count("<tr>") == 2  # one row per arm
    assert t.count("<td></td>") == 3  # missing cells stay empty
    assert H._table_html([], None, None, [], "x") == "<p><em>nothing to show</em></p>"


def test_kv_table_and_baselines_escape_and_show_cis():
    assert H._kv_table({"a<": "b&"}) == '<table class="kv"><tr><th>a&lt;</th><td>b&amp;</td></tr></table>'
    bl = H._baselines_html({"mostpop": {"test": {"recall@10": {"value": 0.03, "ci": [0.02, 0.04]}}},
                            "markov": {"test": {"recall@10": 0.08, "ndcg@5": 0.01}}}, "test")
    assert "<th>recall@10</th><th>ndcg@5</th>" in bl
    assert '<td class="num">0.03<br><span class="ci">[0.02, 0.04]</span></td>' in bl
    assert "<tr><th>mostpop</th>" in bl and '<td class="num">&ndash;</td>' in bl  # mostpop has no ndcg@5
    assert H._baselines_html({}, "test") == "<p><em>no baselines reported</em></p>"


def test_cold_section_states_the_definition_and_user_ranges():
    cold = {"definition": {"max_sft_targets": 2, "n_cold_items": 5, "n_items": 50},
            "n_users": {"gti": {"test": [40, 41]}, "mean": {"test": [7, 7]}},
            "rows": [dict(ROW, group="cold/test"), dict(ROW, arm="mean", group="cold/test")], "baselines": {}}
    out = H._cold_html(cold)
    assert out.startswith("<h2>Cold-item slice</h2>") and "<b>2</b> SFT training windows" in out
    assert "(5 of 50 catalog items are cold)" in out
    assert "<tr><th>gti</th><th>test</th><th>40-41</th>" in out and "<tr><th>mean</th><th>test</th><th>7</th>" in out
    assert H._cold_html({"rows": []}) == ""


def test_plots_embedded_and_curve_plots_in_their_section(tmp_path):
    png = tmp_path / "curve_val_mrr.png"
    data = b"\x89PNG fake"
    png.write_bytes(data)
    tag = H._img_tag(png, 'a "b"')
    assert f'src="data:image/png;base64,{base64.b64encode(data).decode()}"' in tag
    assert 'alt="a &quot;b&quot;"' in tag
    assert H._is_curve_plot(png) and not H._is_curve_plot(tmp_path / "spectra_sft.png")
    section = H._curves_html({"val_mrr": {"gti": [[10, 0.5]]}}, {"mrr curve": png})
    assert section.count("<figure>") == 1 and "(10, 0.5)" not in section  # the plot replaces the table
    table = H._curves_html({"val_mrr": {"gti": [[10, 0.5], [20, 0.25]]}}, {})
    assert "<h3>val_mrr</h3>" in table and "<td>(10, 0.5), (20, 0.25)</td>" in table
    assert H._curves_html({}, {}) == ""


def test_wall_time_and_reading_sections():
    wall = {"mean": {"grounding": False, "ground_s": 5.0, "sft_s": 200.0, "total_s": 205.0, "n_runs": 2,
                     "extra_vs_baseline_s": 0.0},
            "gti": {"grounding": True, "ground_s": 100.0, "sft_s": 200.0, "total_s": 300.0, "total_s_std": 1.5,
                    "n_runs": 2, "extra_vs_baseline_s": 95.0}}
    out = H._wall_time_html(wall, "mean")
    assert "<th>vs mean</th>" in out and '<td class="num">300 &plusmn; 1.5</td><td class="num">+95.0 s</td>' in out
    assert "<tr><th>gti</th><td>yes</td>" in out and "<tr><th>mean</th><td>no</td>" in out
    assert H._wall_time_html({}, "mean") == ""
    assert H._reading_html(["a < b"]) == '<h3>Reading</h3><ul class="reading"><li>a &lt; b</li></ul>'
    assert H._reading_html([]) == ""


def test_render_html_of_a_minimal_document():
    doc = {"title": "T<1>", "created": "now", "split": "test", "baseline_arm": "mean", "arms": ["gti"],
           "seeds_per_arm": {"gti": 1}, "metrics": [ROW], "diagnostics": [],
           "runs": [{"arm": "gti", "seed": 0, "run_dir": "/r", "facts": {"steps": 10, "device": "cpu"}}],
           "configs": {"gti": {"lr": 0.1}}, "versions": {"torch": "2"},
           "rsa_levels": [{"arm": "gti", "phase": "sft", "level": 0, "pearson": 0.5, "spearman": None}]}
    page = H.render_html(doc, {})
    assert page.startswith('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>T&lt;1&gt;</title>')
    assert page.endswith("</body></html>\n") and "<script" not in page
    assert '<td class="num">0.5</td><td class="num">&ndash;</td></tr>' in page  # RSA per level
    assert "<td>steps=10, device=cpu</td>" in page and "&quot;lr&quot;: 0.1" in page
    assert "<h2>Plots</h2>" not in page and "Cold-item slice" not in page
