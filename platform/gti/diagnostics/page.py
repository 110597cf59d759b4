"""The report's HTML page: one self-contained file, inline CSS, plots as base64 `data:` URIs.

What it is for: rendering a report document (the dict written to report.json) and its plot
files as HTML -- pivoted metric / cold / diagnostics tables whose cells carry the exact JSON
numbers as data-* attributes, the reference baselines, the reading, learning curves, wall
time, per-level RSA, runs, configs and package versions. No scripts, no external assets.

What it does not know: how the numbers were computed (it only formats the document's rows),
run records, where the page is written.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from gti.diagnostics.stats import _num, _pct, fmt, higher_is_better, metric_entry

def _data_attrs(row: Mapping[str, Any]) -> str:
    """data-* attributes carrying the exact JSON numbers of a cell (repr, round-trips)."""
    keys = ("arm", "group", "name", "mean", "std", "ci_lo", "ci_hi", "lift")
    parts = []
    for k in keys:
        v = row.get(k)
        s = "" if v is None else (repr(float(v)) if isinstance(v, (int, float)) else str(v))
        parts.append(f'data-{k.replace("_", "-")}="{html.escape(s, quote=True)}"')
    return " ".join(parts)


def _metric_cell(row: Mapping[str, Any]) -> str:
    txt = fmt(row["mean"])
    if row.get("std") is not None:
        txt += f" &plusmn; {fmt(row['std'])}"
    if row.get("ci_lo") is not None:
        txt += f'<br><span class="ci">[{fmt(row["ci_lo"])}, {fmt(row["ci_hi"])}]</span>'
    if row.get("lift") is not None:
        v = (row.get("verdict") or "").replace(" (no CI)", "")
        cls = "lift good" if v == "better" else "lift bad" if v == "worse" else "lift"
        title = f' title="{html.escape(row["verdict"], quote=True)}"' if row.get("verdict") else ""
        lift = f'<br><span class="{cls}"{title}>{_pct(row["lift"])}'
        if row.get("lift_ci_lo") is not None:
            lift += f' [{_pct(row["lift_ci_lo"])}, {_pct(row["lift_ci_hi"])}]'
        txt += lift + "</span>"
    return f'<td class="num" {_data_attrs(row)}>{txt}</td>'


def _pivot(rows: Sequence[Mapping[str, Any]], row_key, col_key) -> tuple[list, list, dict]:
    rkeys, ckeys, cells = [], [], {}
    for r in rows:
        rk, ck = row_key(r), col_key(r)
        if rk not in rkeys:
            rkeys.append(rk)
        if ck not in ckeys:
            ckeys.append(ck)
        cells[(rk, ck)] = r
    return rkeys, ckeys, cells


def _col_label(name: Any) -> str:
    """Column header: the metric name, with a down arrow when lower is better."""
    n = html.escape(str(name))
    return n if higher_is_better(str(name)) else f'{n} <span title="lower is better">&darr;</span>'


def _table_html(rows, row_key, col_key, row_headers: Sequence[str], cls: str, col_label=None) -> str:
    if not rows:
        return "<p><em>nothing to show</em></p>"
    rkeys, ckeys, cells = _pivot(rows, row_key, col_key)
    out = [f'<table class="{cls}"><thead><tr>']
    out += [f"<th>{html.escape(h)}</th>" for h in row_headers]
    out += [f"<th>{col_label(c) if col_label else html.escape(str(c))}</th>" for c in ckeys]
    out.append("</tr></thead><tbody>")
    for rk in rkeys:
        rk_t = rk if isinstance(rk, tuple) else (rk,)
        out.append("<tr>" + "".join(f"<th>{html.escape(str(x))}</th>" for x in rk_t))
        for ck in ckeys:
            r = cells.get((rk, ck))
            out.append(_metric_cell(r) if r else "<td></td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _kv_table(d: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in d.items()
    )
    return f'<table class="kv">{rows}</table>'


def _baselines_html(baselines: Mapping[str, Any], split: str) -> str:
    if not baselines:
        return "<p><em>no baselines reported</em></p>"
    rows, names = [], []
    for b, m in baselines.items():
        src = m.get(split, m) if isinstance(m, dict) else {}
        for k in src:
            if k not in names:
                names.append(k)
        rows.append((b, src))
    out = ["<table><thead><tr><th>baseline</th>"]
    out += [f"<th>{html.escape(n)}</th>" for n in names] + ["</tr></thead><tbody>"]
    for b, src in rows:
        out.append(f"<tr><th>{html.escape(str(b))}</th>")
        for n in names:
            v, ci = metric_entry(src.get(n))
            cell = fmt(v) + (f'<br><span class="ci">[{fmt(ci[0])}, {fmt(ci[1])}]</span>' if ci else "")
            out.append(f'<td class="num">{cell}</td>')
        out.append("</tr>")
    return "".join(out) + "</tbody></table>"


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;margin:.8em 0;font-size:.85em}
th,td{border:1px solid #ddd;padding:.35em .6em;vertical-align:top}
thead th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}
.ci{color:#666;font-size:.85em}.lift{color:#555;font-size:.85em}
.lift.good{color:#1a6d2f;font-weight:600}.lift.bad{color:#a61b1b;font-weight:600}
.kv th{text-align:left;background:#fafafa}
figure{display:inline-block;margin:.5em;vertical-align:top}
figure img{max-width:560px;border:1px solid #eee}figcaption{font-size:.8em;color:#555}
pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:.8em;max-height:30em}
.note{color:#555;font-size:.85em}
"""


def _img_tag(path: Path, caption: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    cap = html.escape(caption)
    return (
        f'<figure><img alt="{cap}" src="data:image/png;base64,{data}">'
        f"<figcaption>{cap}</figcaption></figure>"
    )


CURVE_PLOT_PREFIX = "curve_"


def _is_curve_plot(path: Path) -> bool:
    return Path(path).name.startswith(CURVE_PLOT_PREFIX)


def _reading_html(lines: Sequence[str]) -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(x)}</li>" for x in lines)
    return f'<h3>Reading</h3><ul class="reading">{items}</ul>'


def _cold_html(cold: Mapping[str, Any]) -> str:
    rows = cold.get("rows") or []
    if not rows:
        return ""
    d = cold.get("definition") or {}
    n_users = cold.get("n_users") or {}

    def users(arm: str, split: str) -> str:
        ns = [int(n) for n in (n_users.get(arm) or {}).get(split) or [] if _num(n) is not None]
        if not ns:
            return ""
        return str(ns[0]) if min(ns) == max(ns) else f"{min(ns)}-{max(ns)}"

    out = [
        "<h2>Cold-item slice</h2>",
        '<p class="note">Users whose held-out target is the target of at most '
        f"<b>{html.escape(str(d.get('max_sft_targets', '?')))}</b> SFT training windows "
        f"({html.escape(str(d.get('n_cold_items', '?')))} of {html.escape(str(d.get('n_items', '?')))} "
        "catalog items are cold). Each cell: mean &plusmn; std over seeds; [per-seed 95% user-bootstrap "
        "CI bounds, averaged]; lift vs the baseline arm [seed-bootstrap CI]. users: cold users "
        "evaluated per seed (range when seeds differ).</p>",
        _table_html(
            rows, lambda r: (r["arm"], r["group"].split("/", 1)[-1], users(r["arm"], r["group"].split("/", 1)[-1])),
            lambda r: r["name"], ["arm", "split", "users"], "cold", _col_label,
        ),
    ]
    for split, bl in (cold.get("baselines") or {}).items():
        if bl:
            out.append(f"<h3>Reference baselines on the cold slice ({html.escape(split)}, first run)</h3>")
            out.append(_baselines_html(bl, split))
    return "".join(out)


def _curves_html(curves: Mapping[str, Any], plots: Mapping[str, Path]) -> str:
    pics = {c: p for c, p in plots.items() if _is_curve_plot(p)}
    if not curves and not pics:
        return ""
    out = ["<h2>Learning curves (SFT validation)</h2>",
           '<p class="note">Validation metrics every <code>sft.val_every</code> SFT steps: mean over '
           "seeds, shaded band = min&ndash;max over seeds. x = SFT step (grounding, where an arm has "
           "it, happened before step 0). Raw points: report.json <code>learning_curves</code>.</p>"]
    out += [_img_tag(p, cap) for cap, p in pics.items()]
    if curves and not pics:
        for metric, arms in curves.items():
            out.append(f"<h3>{html.escape(metric)}</h3><table><thead><tr><th>arm</th>"
                       "<th>(step, mean)</th></tr></thead><tbody>")
            for arm, pts in arms.items():
                cells = ", ".join(f"({p[0]}, {fmt(p[1])})" for p in pts)
                out.append(f"<tr><th>{html.escape(arm)}</th><td>{cells}</td></tr>")
            out.append("</tbody></table>")
    return "".join(out)


def _wall_time_html(wall: Mapping[str, Mapping[str, Any]], baseline_arm: str) -> str:
    if not wall:
        return ""
    out = [
        "<h2>Wall time</h2>",
        '<p class="note">Stage wall seconds, mean over seeds: the ground stage (initialisation, plus '
        "grounding training where the arm grounds) and the SFT stage; total = their sum. compute = "
        "seconds inside forward/backward/optimizer steps of the training loop. Evaluation and "
        "shared stages are not counted.</p>",
        '<table class="wall"><thead><tr><th>arm</th><th>grounding</th><th>ground s</th>'
        "<th>ground compute s</th><th>SFT s</th><th>SFT compute s</th><th>total s</th>"
        f"<th>vs {html.escape(baseline_arm)}</th><th>runs</th></tr></thead><tbody>",
    ]
    for arm, w in wall.items():
        extra = _num(w.get("extra_vs_baseline_s"))
        extra_s = "&ndash;" if extra is None else f"{extra:+.1f} s"
        total = fmt(w.get("total_s"))
        if w.get("total_s_std") is not None:
            total += f" &plusmn; {fmt(w['total_s_std'])}"
        out.append(
            f"<tr><th>{html.escape(arm)}</th><td>{'yes' if w.get('grounding') else 'no'}</td>"
            + "".join(f'<td class="num">{fmt(w.get(k))}</td>'
                      for k in ("ground_s", "ground_compute_s", "sft_s", "sft_compute_s"))
            + f'<td class="num">{total}</td><td class="num">{extra_s}</td>'
            f'<td class="num">{w.get("n_runs", "")}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def _pairwise_html(rows: Sequence[Mapping[str, Any]]) -> str:
    """Arm against arm (beside the baseline): each cell's lift is against the arm its row names."""
    if not rows:
        return ""
    return (
        "<h3>Arm against arm</h3>"
        '<p class="note">The same metrics, each arm against a later non-baseline arm (row: '
        "&lsquo;arm vs reference&rsquo;); lift = mean_arm / mean_reference &minus; 1 [95% CI, "
        "paired over users where per-user values exist].</p>"
        + _table_html(rows, lambda r: (r["arm"], r["group"].split(" vs ", 1)[-1]), lambda r: r["name"],
                      ["arm", "vs"], "pairwise", _col_label)
    )


def render_html(doc: Mapping[str, Any], plots: Mapping[str, Path]) -> str:
    """The HTML page for a report document (as written to report.json) and its plot files."""
    split = doc["split"]
    metrics, diags = doc["metrics"], doc["diagnostics"]
    h = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>{html.escape(doc['title'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(doc['title'])}</h1>",
        _kv_table({
            "created": doc["created"], "arms": ", ".join(doc["arms"]),
            "seeds per arm": ", ".join(f"{a}: {n}" for a, n in doc["seeds_per_arm"].items()),
            "split": split, "baseline arm (lift)": doc["baseline_arm"],
        }),
        f"<h2>Metrics ({html.escape(split)})</h2>",
        '<p class="note">Each cell: mean &plusmn; std over seeds; [95% bootstrap CI]; '
        f"relative lift vs <b>{html.escape(doc['baseline_arm'])}</b> [95% CI] "
        "(green: better, red: worse, i.e. the lift CI excludes 0). "
        "&darr; = lower is better (mean_percentile_rank, invalid_sid_rate): there a negative lift "
        "is an improvement. mrr = mean of 1/rank of the target among all catalog items; "
        "mean_percentile_rank = mean of (rank&minus;1)/(items&minus;1) (0 = first, 0.5 = chance). "
        "CI methods per cell are in report.csv / report.json (<code>ci_method</code>).</p>",
        _table_html(metrics, lambda r: r["arm"], lambda r: r["name"], ["arm"], "metrics", _col_label),
        _pairwise_html(doc.get("pairwise") or []),
        _reading_html(doc.get("reading") or []),
        "<h2>Reference baselines</h2>",
        _baselines_html(doc.get("baselines") or {}, split),
        _cold_html(doc.get("cold") or {}),
        _curves_html(doc.get("learning_curves") or {}, plots),
        _wall_time_html(doc.get("wall_time") or {}, doc["baseline_arm"]),
        "<h2>Embedding diagnostics</h2>",
        '<p class="note">effective_rank: exp(entropy of normalised singular values) of E_new; '
        "block_contrast: mean within-level minus mean across-level SID&ndash;SID cosine; "
        "rsa_*: correlation of within-level cosine upper triangles of RQ-VAE code vectors vs "
        "SID embeddings (block diagonal, all levels); mean_cosine_new(_text): mean cosine among "
        "SID rows (and vs sampled text rows). &ndash; = undefined (e.g. RSA of identical rows).</p>",
        _table_html(
            diags, lambda r: (r["arm"], r["group"]), lambda r: r["name"], ["arm", "phase"], "diagnostics"
        ),
    ]
    if doc.get("rsa_levels"):
        h.append("<h3>RSA per level</h3><table><thead><tr><th>arm</th><th>phase</th><th>level</th>"
                 "<th>pearson</th><th>spearman</th></tr></thead><tbody>")
        for r in doc["rsa_levels"]:
            h.append(
                f"<tr><th>{html.escape(r['arm'])}</th><td>{r['phase']}</td><td>{r['level']}</td>"
                f'<td class="num">{fmt(r["pearson"])}</td><td class="num">{fmt(r["spearman"])}</td></tr>'
            )
        h.append("</tbody></table>")
    other = {c: p for c, p in plots.items() if not _is_curve_plot(p)}
    if other:
        h.append("<h2>Plots</h2>")
        h += [_img_tag(p, cap) for cap, p in other.items()]
    h.append("<h2>Runs</h2><table><thead><tr><th>arm</th><th>seed</th><th>run dir</th>"
             "<th>facts</th></tr></thead><tbody>")
    for r in doc["runs"]:
        facts = ", ".join(f"{k}={fmt(v) if isinstance(v, (int, float)) else v}"
                          for k, v in (r.get("facts") or {}).items())
        h.append(f"<tr><th>{html.escape(r['arm'])}</th><td>{r['seed']}</td>"
                 f"<td><code>{html.escape(r['run_dir'])}</code></td><td>{facts}</td></tr>")
    h.append("</tbody></table>")
    h.append("<h2>Configs</h2>")
    for arm, cfg in doc["configs"].items():
        h.append(f"<details><summary>{html.escape(arm)}</summary><pre>"
                 f"{html.escape(json.dumps(cfg, indent=2))}</pre></details>")
    h.append("<h2>Package versions</h2>" + _kv_table(doc["versions"]))
    h.append("</body></html>\n")
    return "".join(h)
