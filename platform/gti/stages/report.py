"""Pipeline stage `report`: embedding diagnostics at init / after grounding / after SFT + report.

What it is for: the last stage of a run. It reads, through upstream manifests, the `sid`
codebooks and codebook facts, the `ground` rows before and after grounding (and the model's old
rows for the SID-text cosine), the `sft` rows and `evaluate`'s metrics.json; computes
`gti.diagnostics.geometry.diagnose` per phase, draws the plots and writes report.html /
report.json / report.csv / plots/ for this one run. `gti compare` later reads report.json of many
runs and builds the cross-arm report with the same builder.

What it does not know: how the embeddings were trained, Ray (it needs none: the work is a few
SVDs and cosine matrices on the driver).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gti.diagnostics import geometry as G
from gti.diagnostics import plots as P
from gti.diagnostics.report_files import build_report
from gti.diagnostics.runs import PHASES, RunRecord
from gti.common.errors import DataError
from gti.common.arms import arm_name
from gti.run.manifest import ManifestError, package_versions
from gti.run.contract import StageContext, StageResult

_PHASE_OUTPUT = {
    "init": ("ground", "init_embeddings"),
    "ground": ("ground", "ground_embeddings"),
    "sft": ("sft", "sft_embeddings"),
}
# Which model folder holds the old (text) rows as they were at each phase: old rows are frozen
# during grounding, so the grounded model has the init-time text rows too.
_PHASE_MODEL = {"init": "ground", "ground": "ground", "sft": "sft"}


def arm_label(cfg) -> str:
    """The run's name in reports: `report.label`, else its arm (`gti.common.arms.arm_name`)."""
    if cfg.report.label:
        return cfg.report.label
    return arm_name(cfg.init.method, cfg.ground.enabled and cfg.ground.steps > 0, cfg.sft.multitask, cfg.rl.trains)


def load_matrix(path: Path, key: str) -> np.ndarray:
    """Tensor `key` of a safetensors file as float32 numpy (bf16 files included)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            if key not in fh.keys():
                raise DataError(f"{path}: no tensor '{key}' (has: {sorted(fh.keys())})")
            return fh.get_tensor(key).float().numpy()
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable safetensors file: {err}") from None


def load_codebooks(path: Path) -> list[np.ndarray]:
    """Code vectors `level_0`, `level_1`, ... in level order (stops at the first missing level)."""
    from safetensors import safe_open

    out = []
    with safe_open(str(path), framework="pt") as fh:
        keys = set(fh.keys())
        while f"level_{len(out)}" in keys:
            out.append(fh.get_tensor(f"level_{len(out)}").float().numpy())
    if not out:
        raise DataError(f"{path}: no 'level_0' tensor (has: {sorted(keys)})")
    return out


_EMBED_KEYS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def text_rows(model_dir: Path, n_old: int, sample: int) -> np.ndarray | None:
    """An evenly spaced sample of `sample` input-embedding rows with id < n_old, or None.

    Reads only the slice of rows it needs from the model's safetensors shards.
    """
    from safetensors import safe_open

    if sample <= 0 or n_old <= 0 or not model_dir.is_dir():
        return None
    idx = np.unique(np.linspace(0, n_old - 1, min(sample, n_old)).round().astype(int))
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            key = next((k for k in fh.keys() if k.endswith(_EMBED_KEYS)), None)
            if key is None:
                continue
            rows = fh.get_slice(key)[0:n_old]
            return rows[idx].float().numpy()
    return None


def _optional_path(ctx: StageContext, stage: str, output: str) -> Path | None:
    try:
        p = ctx.input(stage, output)
    except ManifestError:
        return None
    return p if p.exists() else None


def _ground_ran(ctx: StageContext) -> bool:
    if not ctx.cfg.ground.enabled or ctx.cfg.ground.steps == 0:
        return False
    try:
        return int(ctx.manifest("ground").facts.get("steps_done", 1)) > 0
    except ManifestError:
        return False


def compute_diagnostics(ctx: StageContext) -> tuple[dict[str, dict[str, Any]], dict[str, np.ndarray], dict[str, Any]]:
    """Per-phase diagnose() dicts, the SID rows per phase, and (text rows per phase).

    The first len(new_tokens) rows of E_new are the SID tokens in level-major order (the
    `extend_tokenizer` contract); rows after them (e.g. <sid_start>/<sid_end> markers) enter the
    spectrum but not the per-level quantities. The "ground" phase is left out when grounding was
    disabled or ran zero steps (its matrix would just repeat the init one)."""
    sid = ctx.manifest("sid")
    sizes = [int(k) for k in sid.fact("codebook_sizes")]
    n_tokens = len(sid.fact("new_tokens"))
    if n_tokens != sum(sizes):
        raise DataError(
            f"sid manifest: {n_tokens} new_tokens but codebook_sizes {sizes} sum to {sum(sizes)}"
        )
    codebooks = load_codebooks(ctx.input("sid", "codebooks"))
    codebooks = [c for c, k in zip(codebooks, sizes) if c.shape[0] == k][: len(sizes)]
    try:
        first_new = int(ctx.manifest("ground").facts["new_token_ids"][0])
    except (ManifestError, KeyError, IndexError, TypeError):
        first_new = 0
    rep = ctx.cfg.report
    diags, sid_rows, texts = {}, {}, {}
    for phase in PHASES:
        if phase == "ground" and not _ground_ran(ctx):
            continue
        path = _optional_path(ctx, *_PHASE_OUTPUT[phase])
        if path is None:
            ctx.log(f"{phase}: no embeddings saved, phase left out")
            continue
        e_new = load_matrix(path, "e_new")
        if e_new.ndim != 2 or e_new.shape[0] < n_tokens:
            raise DataError(f"{path}: e_new has shape {list(e_new.shape)}, need >= {n_tokens} rows")
        model_dir = _optional_path(ctx, _PHASE_MODEL[phase], "model")
        t = text_rows(model_dir, first_new, rep.text_sample) if model_dir else None
        e_sid = e_new[:n_tokens]
        diags[phase] = G.diagnose(
            e_sid, sizes, codebooks, t, e_new=e_new, max_codes_per_level=rep.rsa_max_codes_per_level
        )
        sid_rows[phase], texts[phase] = e_sid, t
        ctx.log(
            f"{phase}: effective rank {diags[phase]['effective_rank']:.2f}, block contrast "
            f"{diags[phase]['block']['contrast']:.3f}, RSA {diags[phase]['rsa']['overall']['pearson']:.3f}"
        )
    return diags, sid_rows, texts


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    sizes = [int(k) for k in ctx.manifest("sid").fact("codebook_sizes")]
    diags, sid_rows, texts = compute_diagnostics(ctx)
    metrics_path = ctx.input("evaluate", "metrics")
    try:
        metrics = json.loads(metrics_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{metrics_path}: unreadable metrics: {err}") from None

    plot_dir = ctx.work_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    label = arm_label(cfg)
    plots: dict[str, Path] = {}
    if diags:
        plots["singular-value spectra (init / ground / sft)"] = P.plot_spectra(
            {ph: d["singular_values"] for ph, d in diags.items()}, plot_dir / "spectra.png",
            title=f"E_new spectrum ({label})",
        )
    for phase, e_sid in sid_rows.items():
        plots[f"SID-SID cosine, {phase}"] = P.plot_sid_heatmap(
            e_sid, sizes, plot_dir / f"sid_sid_{phase}.png",
            title=f"SID-SID cosine by level ({label}, {phase})", max_tokens=cfg.report.max_heatmap_tokens,
        )
        if texts[phase] is not None:
            plots[f"SID-text cosine, {phase}"] = P.plot_sid_text_heatmap(
                e_sid, texts[phase], plot_dir / f"sid_text_{phase}.png", codebook_sizes=sizes,
                title=f"SID-text cosine ({label}, {phase})", max_tokens=cfg.report.max_heatmap_tokens,
            )
    record = RunRecord(
        arm=label, seed=cfg.seed, metrics=metrics, diagnostics=diags,
        config=cfg.model_dump(mode="json"), versions=package_versions(), run_dir=str(ctx.run_dir),
    )
    build_report(
        [record], ctx.work_dir, plots=plots, title=f"gti run report: {label} (seed {cfg.seed})",
        baseline_arm=cfg.report.baseline_arm, n_boot=cfg.report.bootstrap, seed=cfg.seed,
    )
    ctx.log(f"report: {ctx.run_dir / 'report' / 'report.html'}")

    def num(x):
        return None if x is None or not np.isfinite(x) else float(x)

    facts = {
        "label": label,
        "effective_rank": {ph: num(d["effective_rank"]) for ph, d in diags.items()},
        "rsa": {ph: {k: num(d["rsa"]["overall"][k]) for k in ("pearson", "spearman")} for ph, d in diags.items()},
        "block_contrast": {ph: num(d["block"]["contrast"]) for ph, d in diags.items()},
        "plots": sorted(p.name for p in plots.values()),
    }
    return StageResult(
        outputs={
            "report_html": "report.html", "report_json": "report.json",
            "report_csv": "report.csv", "plots": "plots",
        },
        facts=facts,
    )
