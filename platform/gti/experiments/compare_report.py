"""`gti compare`'s report: the finished arm runs (or their records) in one cross-arm report.

What it is for: `write_report` gathers each planned run's record (from its run folder when it
finished here, else from the stored record standing for it) and writes report.html|json|csv and
plots/ into the comparison's folder. `write_maps_report`, for a comparison on several SID maps:
that report over every run of every map (an arm's figures there are the mean over its maps x
seeds), one report per map under `maps/sid<m>/`, and the summary over maps
(`gti.experiments.sid_maps.summarize`: per-map figures, their mean and spread, paired
differences) added to compare.json under `maps`.

What it does not know: how runs are planned or run (`gti.experiments.compare`), how figures
are computed (`gti.diagnostics`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

from gti import config as C
from gti.experiments.records import load_record, run_facts
from gti.experiments.shared_stages import ArmRun, CompareError, map_tag, slug
from gti.experiments.sid_maps import headline, summarize
from gti.common.files import atomic_write_json

# {ArmRun.key: (RunRecord, run facts)} of the runs taken from stored records.
Stored = dict[tuple, tuple[Any, dict[str, Any]]]


def gather(runs: Sequence[ArmRun], stored: Stored | None = None) -> tuple[list[ArmRun], list, list[dict]]:
    """(the runs reported on, their RunRecords, their run facts), in plan order: a run with a
    report in its folder, else the stored record standing for it; runs with neither are left out."""
    stored = stored or {}
    got, records, facts = [], [], []
    for r in runs:
        if (r.run_dir / "report" / "_manifest.json").is_file():
            got.append(r)
            records.append(load_record(r))
            facts.append(run_facts(r))
        elif r.key in stored:
            got.append(r)
            records.append(stored[r.key][0])
            facts.append(stored[r.key][1])
    return got, records, facts


def write_report(
    runs: Sequence[ArmRun], cfg: C.RunConfig, out: Path, title: str, stored: Stored | None = None,
) -> dict[str, Path]:
    """The cross-arm report over the finished runs and the stored records standing for runs
    not here (`stored`), in plan order: spectra per phase, SFT learning curves, heat maps per
    arm (from runs whose folders are here)."""
    got, records, facts = gather(runs, stored)
    if not records:
        raise CompareError(f"no finished arm runs under {out / 'runs'} (nor records) to report on")
    done = [r for r in got if (r.run_dir / "report" / "_manifest.json").is_file()]
    return _build(records, facts, done, cfg, out, title)


def _build(records: list, facts: list[dict], done: Sequence[ArmRun], cfg: C.RunConfig, out: Path,
           title: str) -> dict[str, Path]:
    from gti.diagnostics.report_files import build_report, learning_curve_plots, spectra_plots

    plot_dir = out / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = dict(spectra_plots(records, plot_dir))
    plots.update(learning_curve_plots(records, plot_dir))
    for arm in dict.fromkeys(r.arm for r in done):
        first = next(r for r in done if r.arm == arm)
        for name, caption in (("sid_sid_init", "SID-SID cosine at init"),
                              ("sid_sid_sft", "SID-SID cosine after SFT"),
                              ("sid_text_sft", "SID-text cosine after SFT")):
            src = first.run_dir / "report" / "plots" / f"{name}.png"
            if src.is_file():
                dst = plot_dir / f"{slug(arm)}_seed{first.seed}_{name}.png"
                shutil.copyfile(src, dst)
                plots[f"{arm} (seed {first.seed}): {caption}"] = dst
    return build_report(
        records, out, plots=plots, title=title, baseline_arm=cfg.report.baseline_arm,
        n_boot=cfg.report.bootstrap, seed=cfg.seed, run_facts=facts,
    )


def write_maps_report(
    runs: Sequence[ArmRun], cfg: C.RunConfig, out: Path, title: str, stored: Stored | None = None,
    echo: Callable[[str], None] = lambda m: None,
) -> dict[str, Path]:
    """On several SID maps: the report over every run of every map in `out`, one per map in
    `out/maps/sid<m>/`, and compare.json's `maps` (the summary over maps, `summarize`); the
    mean figures are echoed one line per arm and metric. Returns the pooled report's paths."""
    got, records, facts = gather(runs, stored)
    if not records:
        raise CompareError(f"no finished arm runs under {out / 'runs'} (nor records) to report on")
    done = [r for r in got if (r.run_dir / "report" / "_manifest.json").is_file()]
    paths = _build(records, facts, done, cfg, out, title)
    by_map: dict[int, list] = {}
    map_reports = {}
    for m in dict.fromkeys(r.sid_seed for r in got):
        idx = [i for i, r in enumerate(got) if r.sid_seed == m]
        by_map[m] = [records[i] for i in idx]
        folder = out / "maps" / map_tag(m)
        mine = [r for r in done if r.sid_seed == m]
        map_reports[map_tag(m)] = str(_build(by_map[m], [facts[i] for i in idx], mine, cfg, folder,
                                             f"{title}: map sid.seed={m}")["json"])
    arms = list(dict.fromkeys(r.arm for r in runs))
    summary = summarize(by_map, arms, n_boot=cfg.report.bootstrap, seed=cfg.seed)
    summary["reports"] = map_reports
    plan_path = out / "compare.json"
    doc = json.loads(plan_path.read_text()) if plan_path.is_file() else {}
    atomic_write_json(plan_path, {**doc, "maps": summary})
    for line in headline(summary):
        echo(line)
    return paths
