"""Tests of gti/diagnostics/plots.py: every plot renders to a real, non-trivial PNG."""

from __future__ import annotations

import numpy as np
import torch

from gti.diagnostics import plots as P

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path, min_bytes=3000):
    data = path.read_bytes()
    return path.is_file() and data[:8] == PNG_MAGIC and len(data) > min_bytes


def test_plot_spectra(tmp_path):
    rng = np.random.default_rng(0)
    spectra = {
        "mean/init": np.linalg.svd(np.tile(rng.normal(size=(1, 16)), (32, 1)), compute_uv=False),
        "gti/ground": np.linalg.svd(rng.normal(size=(32, 16)), compute_uv=False),
        "empty": [],
    }
    out = P.plot_spectra(spectra, tmp_path / "sub" / "spectra.png")
    assert out == tmp_path / "sub" / "spectra.png"
    assert _is_png(out)


def test_plot_sid_heatmap_subsamples(tmp_path):
    rng = np.random.default_rng(1)
    e = torch.tensor(rng.normal(size=(40 + 30, 8)), dtype=torch.float32)
    small = P.plot_sid_heatmap(e, [40, 30], tmp_path / "sid.png", max_tokens=20)
    assert _is_png(small)


def test_plot_sid_text_heatmap(tmp_path):
    rng = np.random.default_rng(2)
    out = P.plot_sid_text_heatmap(
        rng.normal(size=(24, 8)), rng.normal(size=(50, 8)), tmp_path / "st.png", codebook_sizes=[12, 12]
    )
    assert _is_png(out)
    out2 = P.plot_sid_text_heatmap(rng.normal(size=(24, 8)), rng.normal(size=(50, 8)), tmp_path / "st2.png")
    assert _is_png(out2)


def test_plot_learning_curves(tmp_path):
    curves = {
        "mean": {"step": [10, 20, 30], "mean": [3.0, 2.5, 2.2], "lo": [2.9, 2.4, 2.1], "hi": [3.1, 2.6, 2.3]},
        "gti": {"step": [10, 20, 30], "mean": [2.6, 2.3, 2.1]},  # one seed: no band
        "single": {"step": [10], "mean": [2.0], "lo": [1.9], "hi": [2.1]},
        "empty": {"step": [], "mean": []},
    }
    out = P.plot_learning_curves(curves, tmp_path / "c" / "curve_val_loss.png", metric="val_loss")
    assert out == tmp_path / "c" / "curve_val_loss.png"
    assert _is_png(out)
    assert _is_png(P.plot_learning_curves({}, tmp_path / "none.png"), min_bytes=1000)
