"""PNG plots of the embedding diagnostics (matplotlib, headless Agg backend).

What it is for: four pictures, each written to a PNG whose path is returned:
- `plot_spectra`: normalised singular-value spectra of E_new, one line per arm/phase, log y;
- `plot_sid_heatmap`: the SID-SID cosine matrix ordered by code level, with level boundaries;
- `plot_sid_text_heatmap`: cosine between SID rows and a sample of old text-token rows;
- `plot_learning_curves`: one validation metric against the training step, a line per arm
  (mean over seeds) with a shaded min-max band.

What it does not know: where the matrices come from or what the numbers mean for the paper;
it takes arrays (numpy or torch) and labels. It never calls `plt.show()` and never uses the
pyplot global figure registry, so it is safe in worker processes and threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: CI machines and Ray workers have no display

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from gti.diagnostics.geometry import as_array, cosine_matrix, subsample_levels  # noqa: E402

_DPI = 110
_FLOOR = 1e-6


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=_DPI, bbox_inches="tight")
    return path


def plot_spectra(
    spectra: Mapping[str, Sequence[float]], path: str | Path, title: str = "Singular-value spectrum of E_new"
) -> Path:
    """One line per label: singular values [k] divided by their sum, against their index (log y).

    Normalising by the sum puts matrices of different scale on one axis and makes the area
    under each curve the distribution whose entropy gives the effective rank.
    """
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    plotted = 0
    for label, sv in spectra.items():
        s = np.asarray(sv, dtype=np.float64)
        if s.size == 0 or s.sum() <= 0:
            continue
        # Floor for the log axis: a rank-1 matrix has values ~1e-17 past the first, which would
        # only stretch the axis over 17 decades; 1e-6 still shows "everything after s_1 is 0".
        p = np.maximum(s / s.sum(), _FLOOR)
        ax.plot(np.arange(1, p.size + 1), p, label=str(label), linewidth=1.4)
        plotted += 1
    ax.set_yscale("log")
    ax.set_xlabel("singular value index")
    ax.set_ylabel("normalised singular value  s_i / sum s")
    ax.set_title(title)
    ax.set_ylim(bottom=_FLOOR / 2)
    ax.yaxis.set_minor_formatter(NullFormatter())  # dozens of minor labels: slow, unreadable
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:.0e}"))  # no mathtext: fast
    ax.grid(True, which="major", alpha=0.25)
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no spectra", transform=ax.transAxes, ha="center")
    return _save(fig, path)


def _boundaries(ax, kept: Sequence[int], horizontal: bool = True, vertical: bool = True) -> None:
    edge = -0.5
    for k in kept[:-1]:
        edge += k
        if horizontal:
            ax.axhline(edge, color="black", linewidth=0.8)
        if vertical:
            ax.axvline(edge, color="black", linewidth=0.8)


def plot_sid_heatmap(
    e_sid: Any,
    codebook_sizes: Sequence[int],
    path: str | Path,
    title: str = "SID-SID cosine (ordered by level)",
    max_tokens: int = 256,
) -> Path:
    """Cosine matrix of SID rows e_sid [sum(codebook_sizes), d], level-major, with boundaries.

    At most `max_tokens` rows are shown (an evenly spaced subset of each level, in proportion
    to its size), so a 4 x 256 vocabulary stays readable.
    """
    E = as_array(e_sid)
    idx, kept = subsample_levels(codebook_sizes, max_tokens)
    C = cosine_matrix(E[idx])
    fig = Figure(figsize=(5.6, 4.8))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(C, cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    _boundaries(ax, kept)
    centers = np.cumsum([0, *kept[:-1]]) + np.asarray(kept) / 2 - 0.5
    labels = [f"L{i}" for i in range(len(kept))]
    ax.set_xticks(centers, labels)
    ax.set_yticks(centers, labels)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="cosine")
    return _save(fig, path)


def plot_sid_text_heatmap(
    e_sid: Any,
    text_rows: Any,
    path: str | Path,
    codebook_sizes: Sequence[int] | None = None,
    title: str = "SID-text cosine",
    max_tokens: int = 256,
) -> Path:
    """Cosine between SID rows e_sid [n, d] (rows, level-major) and text rows [m, d] (columns).

    At most `max_tokens` rows and columns are drawn; with `codebook_sizes` the SID rows are
    subsampled per level and level boundaries are drawn as horizontal lines.
    """
    E, T = as_array(e_sid), as_array(text_rows)
    if codebook_sizes is not None:
        idx, kept = subsample_levels(codebook_sizes, max_tokens)
    else:
        idx = np.unique(np.linspace(0, E.shape[0] - 1, min(E.shape[0], max_tokens)).round().astype(int))
        kept = [len(idx)]
    cols = np.unique(np.linspace(0, T.shape[0] - 1, min(T.shape[0], max_tokens)).round().astype(int))
    C = cosine_matrix(E[idx], T[cols])
    fig = Figure(figsize=(6.4, 4.6))
    ax = fig.add_subplot(1, 1, 1)
    lim = max(1e-6, float(np.abs(C).max()))  # text-SID cosines are small; scale to what is there
    im = ax.imshow(C, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    _boundaries(ax, kept, vertical=False)
    ax.set_xlabel(f"old text tokens (sample of {len(cols)})")
    ax.set_ylabel("SID tokens (level-major)")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="cosine")
    return _save(fig, path)


def plot_learning_curves(
    curves: Mapping[str, Mapping[str, Sequence[float]]],
    path: str | Path,
    metric: str = "value",
    title: str | None = None,
    xlabel: str = "SFT step",
) -> Path:
    """One line per label: curves[label] = {"step": [...], "mean": [...]} with optional "lo"
    and "hi" (same length) drawn as a shaded band (e.g. min and max over seeds). A single
    point is drawn as a marker."""
    fig = Figure(figsize=(6.4, 4.0))
    ax = fig.add_subplot(1, 1, 1)
    plotted = 0
    for label, c in curves.items():
        x = np.asarray(c.get("step", []), dtype=np.float64)
        y = np.asarray(c.get("mean", []), dtype=np.float64)
        if x.size == 0 or x.size != y.size:
            continue
        (line,) = ax.plot(x, y, label=str(label), linewidth=1.6, marker="o" if x.size <= 30 else None,
                          markersize=3)
        lo, hi = c.get("lo"), c.get("hi")
        if lo is not None and hi is not None and len(lo) == x.size == len(hi):
            ax.fill_between(x, np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64),
                            color=line.get_color(), alpha=0.18, linewidth=0)
        plotted += 1
    ax.set_xlabel(xlabel)
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} during training", fontsize=10)
    ax.grid(True, alpha=0.25)
    if plotted:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no curves", transform=ax.transAxes, ha="center")
    return _save(fig, path)
