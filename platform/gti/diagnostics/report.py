"""The run/comparison report: one self-contained HTML file plus the same numbers as JSON and CSV.

What it is for: turning per-run records (evaluation metrics, geometry diagnostics, configs,
package versions) of one or many arms x seeds into
- `report.json`: every table, per-run summaries, configs and versions;
- `report.csv`: the metrics and diagnostics tables in long form (one row per arm x split/phase x
  quantity), the very numbers the HTML shows;
- `report.html`: inline CSS, plots embedded as base64 `data:` URIs, no scripts, no external
  assets -- it opens from disk without a server.

Statistics (documented in the report itself):
- mean +- std over seeds (sample std, ddof=1; empty with one seed);
- relative lift against the baseline arm (default `mean`): mean_arm / mean_baseline - 1;
- 95% bootstrap CIs. When every run's metrics.json carries `per_user` values (see
  docs/ARCHITECTURE.md, evaluate row), users are resampled: the arm CI resamples users of the
  per-user mean over seeds, and the lift CI is a *paired* bootstrap over the users both arms
  evaluated. Otherwise the arm CI averages the per-seed user-bootstrap bounds that the
  evaluate stage reported, and the lift CI resamples seeds (only with >= 2 seeds per arm).
  The method used is written next to every CI (`ci_method`).

What it does not know: how runs were produced, Ray, files of other stages (callers pass plain
dicts), or how diagnostics are computed (`gti.diagnostics.geometry`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from gti.manifest import atomic_write_bytes

PHASES = ("init", "ground", "sft")
# Diagnostics shown in the table: (column name, how to read it from geometry.diagnose output).
DIAG_QUANTITIES: list[tuple[str, Sequence[str]]] = [
    ("effective_rank", ("effective_rank",)),
    ("block_contrast", ("block", "contrast")),
    ("rsa_pearson", ("rsa", "overall", "pearson")),
    ("rsa_spearman", ("rsa", "overall", "spearman")),
    ("mean_cosine_new", ("mean_cosine_new",)),
    ("mean_cosine_new_text", ("mean_cosine_new_text",)),
]
CSV_COLUMNS = [
    "table", "arm", "group", "name", "n", "mean", "std", "ci_lo", "ci_hi",
    "lift", "lift_ci_lo", "lift_ci_hi", "ci_method",
]


@dataclass
class RunRecord:
    """Everything the report needs from one finished run (one arm, one seed).

    metrics: the evaluate stage's metrics.json ({"splits": {split: {metric: {"value", "ci"}}},
    "baselines": ..., "invalid_sid_rate": ..., optional "per_user"}); diagnostics:
    {phase: geometry.diagnose(...) dict} for the phases that exist.
    """

    arm: str
    seed: int
    metrics: dict[str, Any] = field(default_factory=dict)
    diagnostics: dict[str, dict[str, Any]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    run_dir: str = ""


# --------------------------------------------------------------------------- helpers
def _num(x: Any) -> float | None:
    """A finite float or None (JSON has no NaN)."""
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _clean(obj: Any) -> Any:
    """Copy of a nested structure with NaN/inf -> None and numpy scalars -> Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return _num(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    return obj


def _dig(d: Any, path: Sequence[str]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def metric_entry(entry: Any) -> tuple[float | None, tuple[float, float] | None]:
    """(value, ci) from a metrics.json entry: {"value": v, "ci": [lo, hi]} or a bare number."""
    if isinstance(entry, dict):
        ci = entry.get("ci")
        ci_t = (float(ci[0]), float(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None
        return _num(entry.get("value")), ci_t
    return _num(entry), None


def _mean_std(vals: Sequence[float]) -> tuple[float | None, float | None]:
    v = [x for x in vals if x is not None]
    if not v:
        return None, None
    mean = float(np.mean(v))
    std = float(np.std(v, ddof=1)) if len(v) >= 2 else None
    return mean, std


def _percentile_ci(samples: np.ndarray) -> tuple[float | None, float | None]:
    s = samples[np.isfinite(samples)]
    if s.size == 0:
        return None, None
    lo, hi = np.percentile(s, [2.5, 97.5])
    return float(lo), float(hi)


def _ordered_arms(records: Sequence[RunRecord]) -> list[str]:
    seen: list[str] = []
    for r in records:
        if r.arm not in seen:
            seen.append(r.arm)
    return seen


def _per_user(rec: RunRecord, split: str, metric: str) -> dict[str, float] | None:
    pu = _dig(rec.metrics, ("per_user", split))
    if not isinstance(pu, dict) or metric not in pu or "user_ids" not in pu:
        return None
    ids, vals = pu["user_ids"], pu[metric]
    if len(ids) != len(vals):
        return None
    return {str(u): float(v) for u, v in zip(ids, vals)}


def _user_means(recs: Sequence[RunRecord], split: str, metric: str) -> dict[str, float] | None:
    """Per-user metric averaged over the seeds of one arm (users every seed evaluated)."""
    maps = [_per_user(r, split, metric) for r in recs]
    if not maps or any(m is None for m in maps):
        return None
    common = set(maps[0]).intersection(*maps[1:])
    return {u: float(np.mean([m[u] for m in maps])) for u in sorted(common)}


# --------------------------------------------------------------------------- tables
def metric_names(records: Sequence[RunRecord], split: str) -> list[str]:
    """Metric names of `split` in first-seen order, plus invalid_sid_rate when reported."""
    names: list[str] = []
    for r in records:
        for m in (_dig(r.metrics, ("splits", split)) or {}):
            if m not in names:
                names.append(m)
    if any(_num(r.metrics.get("invalid_sid_rate")) is not None for r in records):
        names.append("invalid_sid_rate")
    return names


def _values(recs: Sequence[RunRecord], split: str, metric: str):
    vals, cis = [], []
    for r in recs:
        if metric == "invalid_sid_rate":
            v, ci = _num(r.metrics.get("invalid_sid_rate")), None
        else:
            v, ci = metric_entry(_dig(r.metrics, ("splits", split, metric)))
        vals.append(v)
        cis.append(ci)
    return vals, cis


def metrics_table(
    records: Sequence[RunRecord],
    split: str = "test",
    baseline_arm: str = "mean",
    n_boot: int = 1000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Long-form metrics rows: one per arm x metric, with mean, std, CI and lift vs baseline."""
    rng = np.random.default_rng(seed)
    arms = _ordered_arms(records)
    by_arm = {a: [r for r in records if r.arm == a] for a in arms}
    base = by_arm.get(baseline_arm)
    rows = []
    for metric in metric_names(records, split):
        base_vals = _values(base, split, metric)[0] if base else None
        base_mean = _mean_std(base_vals)[0] if base_vals else None
        base_users = _user_means(base, split, metric) if base else None
        for arm in arms:
            recs = by_arm[arm]
            vals, cis = _values(recs, split, metric)
            mean, std = _mean_std(vals)
            row: dict[str, Any] = {
                "table": "metrics", "arm": arm, "group": split, "name": metric,
                "n": sum(v is not None for v in vals), "mean": mean, "std": std,
                "ci_lo": None, "ci_hi": None, "lift": None, "lift_ci_lo": None, "lift_ci_hi": None,
                "ci_method": "",
            }
            users = _user_means(recs, split, metric)
            if users and n_boot > 0:
                x = np.array(list(users.values()))
                idx = rng.integers(0, x.size, size=(n_boot, x.size))
                row["ci_lo"], row["ci_hi"] = _percentile_ci(x[idx].mean(axis=1))
                row["ci_method"] = "user bootstrap"
            elif any(c is not None for c in cis):
                got = [c for c in cis if c is not None]
                row["ci_lo"] = float(np.mean([c[0] for c in got]))
                row["ci_hi"] = float(np.mean([c[1] for c in got]))
                row["ci_method"] = "per-seed user bootstrap, bounds averaged"
            if base_mean not in (None, 0.0) and mean is not None:
                row["lift"] = mean / base_mean - 1.0
                if arm != baseline_arm and n_boot > 0:
                    row["lift_ci_lo"], row["lift_ci_hi"], how = _lift_ci(
                        users, base_users, vals, base_vals, n_boot, rng
                    )
                    row["ci_method"] += f"; lift: {how}" if how else ""
            rows.append(row)
    return rows


def _lift_ci(users, base_users, vals, base_vals, n_boot, rng):
    if users and base_users:
        common = sorted(set(users) & set(base_users))
        if len(common) >= 2:
            a = np.array([users[u] for u in common])
            b = np.array([base_users[u] for u in common])
            idx = rng.integers(0, len(common), size=(n_boot, len(common)))
            with np.errstate(divide="ignore", invalid="ignore"):
                lifts = a[idx].mean(1) / b[idx].mean(1) - 1.0
            lo, hi = _percentile_ci(lifts)
            return lo, hi, "paired user bootstrap"
    a = np.array([v for v in vals if v is not None])
    b = np.array([v for v in (base_vals or []) if v is not None])
    if a.size >= 2 and b.size >= 2:
        ia = rng.integers(0, a.size, size=(n_boot, a.size))
        ib = rng.integers(0, b.size, size=(n_boot, b.size))
        with np.errstate(divide="ignore", invalid="ignore"):
            lifts = a[ia].mean(1) / b[ib].mean(1) - 1.0
        lo, hi = _percentile_ci(lifts)
        return lo, hi, "seed bootstrap"
    return None, None, ""


def diagnostics_table(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Long-form diagnostics rows: one per arm x phase x quantity, mean and std over seeds."""
    rows = []
    for arm in _ordered_arms(records):
        recs = [r for r in records if r.arm == arm]
        for phase in PHASES:
            have = [r.diagnostics[phase] for r in recs if phase in r.diagnostics]
            if not have:
                continue
            for name, path in DIAG_QUANTITIES:
                vals = [_num(_dig(d, path)) for d in have]
                if all(v is None for v in vals) and name.startswith("mean_cosine_new_text"):
                    continue  # no text rows were sampled for this run
                mean, std = _mean_std(vals)
                rows.append({
                    "table": "diagnostics", "arm": arm, "group": phase, "name": name,
                    "n": sum(v is not None for v in vals), "mean": mean, "std": std,
                    "ci_lo": None, "ci_hi": None, "lift": None, "lift_ci_lo": None,
                    "lift_ci_hi": None, "ci_method": "",
                })
    return rows


def rsa_level_table(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per-level RSA (Pearson, Spearman) per arm x phase, mean over seeds."""
    rows = []
    for arm in _ordered_arms(records):
        recs = [r for r in records if r.arm == arm]
        for phase in PHASES:
            levels: dict[int, list[tuple[float | None, float | None]]] = {}
            for r in recs:
                for lv in _dig(r.diagnostics.get(phase, {}), ("rsa", "per_level")) or []:
                    levels.setdefault(int(lv["level"]), []).append(
                        (_num(lv.get("pearson")), _num(lv.get("spearman")))
                    )
            for lvl, pairs in sorted(levels.items()):
                rows.append({
                    "arm": arm, "phase": phase, "level": lvl,
                    "pearson": _mean_std([p for p, _ in pairs])[0],
                    "spearman": _mean_std([s for _, s in pairs])[0],
                })
    return rows


# --------------------------------------------------------------------------- rendering
def fmt(x: Any, digits: int = 4) -> str:
    """Human number: 4 significant digits, '-' for missing."""
    v = _num(x)
    if v is None:
        return "&ndash;"
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def _pct(x: Any) -> str:
    v = _num(x)
    return "&ndash;" if v is None else f"{v * 100:+.1f}%"


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
        lift = f'<br><span class="lift">{_pct(row["lift"])}'
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


def _table_html(rows, row_key, col_key, row_headers: Sequence[str], cls: str) -> str:
    if not rows:
        return "<p><em>nothing to show</em></p>"
    rkeys, ckeys, cells = _pivot(rows, row_key, col_key)
    out = [f'<table class="{cls}"><thead><tr>']
    out += [f"<th>{html.escape(h)}</th>" for h in row_headers]
    out += [f"<th>{html.escape(str(c))}</th>" for c in ckeys]
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
.ci{color:#666;font-size:.85em}.lift{color:#1a6d2f;font-size:.85em}
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
        f"relative lift vs <b>{html.escape(doc['baseline_arm'])}</b> [95% CI]. "
        "CI methods per cell are in report.csv / report.json (<code>ci_method</code>).</p>",
        _table_html(metrics, lambda r: r["arm"], lambda r: r["name"], ["arm"], "metrics"),
        "<h2>Reference baselines</h2>",
        _baselines_html(doc.get("baselines") or {}, split),
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
    if plots:
        h.append("<h2>Plots</h2>")
        h += [_img_tag(p, cap) for cap, p in plots.items()]
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


def _csv_text(rows: Iterable[Mapping[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else (repr(r[k]) if isinstance(r[k], float) else r[k]))
                    for k in CSV_COLUMNS})
    return buf.getvalue()


def build_report(
    records: Sequence[RunRecord],
    out_dir: str | Path,
    plots: Mapping[str, str | Path] | None = None,
    title: str = "gti report",
    split: str = "test",
    baseline_arm: str = "mean",
    n_boot: int = 1000,
    seed: int = 0,
    run_facts: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Path]:
    """Write report.html, report.json and report.csv into out_dir; return their paths.

    plots: {caption: png path}; they are embedded, so the HTML can be moved on its own.
    run_facts: optional short facts per record (same order) shown in the runs table.
    """
    if not records:
        raise ValueError("a report needs at least one run record")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms = _ordered_arms(records)
    if split not in {s for r in records for s in (_dig(r.metrics, ("splits",)) or {})}:
        # fall back to a split that exists (e.g. evaluation ran on `valid` only)
        splits = [s for r in records for s in (_dig(r.metrics, ("splits",)) or {})]
        split = splits[0] if splits else split
    versions: dict[str, str] = {}
    for r in records:
        for k, v in r.versions.items():
            versions.setdefault(k, v)
    configs: dict[str, Any] = {}
    for r in records:
        configs.setdefault(r.arm, r.config)
    baselines = next((r.metrics.get("baselines") for r in records if r.metrics.get("baselines")), {})
    doc = {
        "title": title,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "split": split,
        "baseline_arm": baseline_arm,
        "arms": arms,
        "seeds_per_arm": {a: sum(r.arm == a for r in records) for a in arms},
        "metrics": metrics_table(records, split, baseline_arm, n_boot, seed),
        "diagnostics": diagnostics_table(records),
        "rsa_levels": rsa_level_table(records),
        "baselines": baselines,
        "runs": [
            {"arm": r.arm, "seed": r.seed, "run_dir": r.run_dir,
             "facts": dict(run_facts[i]) if run_facts else {},
             "diagnostics": {ph: {k: v for k, v in d.items()} for ph, d in r.diagnostics.items()}}
            for i, r in enumerate(records)
        ],
        "configs": configs,
        "versions": versions,
        "plots": {cap: Path(p).name for cap, p in (plots or {}).items()},
    }
    doc = _clean(doc)
    paths = {"html": out / "report.html", "json": out / "report.json", "csv": out / "report.csv"}
    atomic_write_bytes(paths["json"], (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode())
    atomic_write_bytes(paths["csv"], _csv_text(doc["metrics"] + doc["diagnostics"]).encode())
    atomic_write_bytes(paths["html"], render_html(doc, {c: Path(p) for c, p in (plots or {}).items()}).encode())
    return paths


def spectra_plots(records: Sequence[RunRecord], plot_dir: str | Path) -> dict[str, Path]:
    """One spectrum plot per phase, a line per arm (its first seed); {caption: png path}."""
    from gti.diagnostics.plots import plot_spectra

    out = {}
    for phase in PHASES:
        spectra = {}
        for arm in _ordered_arms(records):
            rec = next((r for r in records if r.arm == arm and phase in r.diagnostics), None)
            sv = _dig(rec.diagnostics[phase], ("singular_values",)) if rec else None
            if sv:
                spectra[f"{arm} (seed {rec.seed})"] = sv
        if spectra:
            out[f"singular-value spectra after {phase}" if phase != "init" else "singular-value spectra at init"] = (
                plot_spectra(spectra, Path(plot_dir) / f"spectra_{phase}.png",
                             title=f"E_new spectrum ({phase})")
            )
    return out
