"""The report's numbers in plain words (the "Reading" section and report.json "reading").

What it is for: per arm, which metrics are better / worse than the baseline arm (the lift CI
read with the metric's direction), on all users and on the cold slice, and against each later
non-baseline arm (the pairwise rows); each learning curve
against the baseline arm's (ahead / behind at the first and last common step, who catches
up); the extra wall time.

What it does not know: how the tables are computed (`gti.diagnostics.tables`; it reads their
rows), HTML, files.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from gti.diagnostics.stats import _pct_plain, fmt_plain, higher_is_better

def _standing(p: Mapping[str, float], b: Mapping[str, float], up: bool) -> str:
    """'ahead of' / 'behind' / 'level with' for curve point p against baseline point b."""
    if p["mean"] == b["mean"]:
        return "level with"
    ahead = (p["mean"] > b["mean"]) == up
    apart = p["min"] > b["max"] or p["max"] < b["min"]
    overlap = not apart and (p["n"] > 1 or b["n"] > 1)
    return ("ahead of" if ahead else "behind") + (" (seed ranges overlap)" if overlap else "")


def curve_reading(curves: Mapping[str, Mapping[str, Sequence[Mapping[str, float]]]],
                  baseline_arm: str) -> list[str]:
    """Plain-words reading of each arm's curve against the baseline arm's: ahead / behind at
    the first and the last validation step both logged (mean over seeds; "seed ranges
    overlap" when the min-max bands touch), and who catches up in between."""
    out = []
    for metric, arms in curves.items():
        base = {p["step"]: p for p in arms.get(baseline_arm) or []}
        up = higher_is_better(metric)
        for arm, pts in arms.items():
            common = [p for p in pts if p["step"] in base]
            if arm == baseline_arm or not common:
                continue
            first, last = common[0], common[-1]
            s0, s1 = _standing(first, base[first["step"]], up), _standing(last, base[last["step"]], up)
            text = (f"{metric}: {arm} starts {s0} {baseline_arm} at step {first['step']} "
                    f"({fmt_plain(first['mean'])} vs {fmt_plain(base[first['step']]['mean'])})")
            if last is not first:
                text += (f" and is {s1} it at step {last['step']} "
                         f"({fmt_plain(last['mean'])} vs {fmt_plain(base[last['step']]['mean'])})")
                if s0.startswith("ahead") and not s1.startswith("ahead"):
                    text += f"; {baseline_arm} catches up"
                elif s0.startswith("behind") and not s1.startswith("behind"):
                    text += f"; {arm} catches up" + (" and overtakes" if s1.startswith("ahead") else "")
            text += f" [{'higher' if up else 'lower'} is better]."
            out.append(text)
    return out


def reading(doc: Mapping[str, Any]) -> list[str]:
    """The report's numbers in plain words: per arm, which metrics are better / worse than the
    baseline arm (lift CI excluding 0, direction-aware), on all users and on the cold slice;
    then the learning-curve reading."""
    base = doc["baseline_arm"]
    lines = []
    sources = (("", doc["metrics"]), (" on the cold slice", (doc.get("cold") or {}).get("rows") or []),
               ("", doc.get("pairwise") or []))
    for label, rows in sources:
        groups: dict[tuple[str, str], dict[str, list[str]]] = {}
        for r in rows:
            if r["arm"] == base or not r.get("verdict"):
                continue
            v = r["verdict"].replace(" (no CI)", "")
            key = "better" if v == "better" else "worse" if v == "worse" else "unclear"
            if r.get("lift_ci_lo") is None:
                key += "_noci"
            lift = _pct_plain(r["lift"])
            if r.get("lift_ci_lo") is not None:
                lift += f" [{_pct_plain(r['lift_ci_lo'])}, {_pct_plain(r['lift_ci_hi'])}]"
            arrow = "" if r.get("direction", "higher") == "higher" else ", lower is better"
            groups.setdefault((r["arm"], r["group"]), {}).setdefault(key, []).append(
                f"{r['name']} ({lift}{arrow})"
            )
        for (arm, group), g in groups.items():
            parts = []
            if g.get("better"):
                parts.append("better on " + "; ".join(g["better"]))
            if g.get("worse"):
                parts.append("worse on " + "; ".join(g["worse"]))
            if g.get("unclear"):
                parts.append("no clear difference (95% CI of the lift contains 0) on "
                             + ", ".join(x.split(" (")[0] for x in g["unclear"]))
            for k, word in (("better_noci", "better by the point estimate only (no CI)"),
                            ("worse_noci", "worse by the point estimate only (no CI)"),
                            ("unclear_noci", "equal (no CI)")):
                if g.get(k):
                    parts.append(f"{word} on " + ", ".join(x.split(" (")[0] for x in g[k]))
            grp = group.split("/", 1)[-1]
            grp, _, ref = grp.partition(" vs ")  # a pairwise row names its reference arm
            lines.append(f"{arm} vs {ref or base} ({grp}){label}: " + "; ".join(parts) + ".")
    lines += doc.get("curve_reading") or []
    wt = doc.get("wall_time") or {}
    for arm, w in wt.items():
        if arm != base and w.get("extra_vs_baseline_s") is not None and base in wt:
            lines.append(
                f"wall time: {arm} takes {fmt_plain(w['total_s'])} s (ground + SFT stages), "
                f"{fmt_plain(abs(w['extra_vs_baseline_s']))} s {'more' if w['extra_vs_baseline_s'] >= 0 else 'less'}"
                f" than {base}."
            )
    return lines
