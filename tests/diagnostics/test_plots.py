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
