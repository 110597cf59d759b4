"""Tests of gti/diagnostics/geometry.py on matrices whose answers are known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gti.diagnostics import geometry as G


def test_effective_rank_identity_is_n():
    for n in (1, 5, 32):
        assert G.effective_rank(np.eye(n)) == pytest.approx(n, rel=1e-9)


def test_effective_rank_rank_one_is_one():
    rng = np.random.default_rng(0)
    u, v = rng.normal(size=(40, 1)), rng.normal(size=(1, 16))
    assert G.effective_rank(u @ v) == pytest.approx(1.0, abs=1e-6)
    # mean initialisation: every new row the same vector
    mean_init = np.tile(rng.normal(size=(1, 16)), (64, 1))
    assert G.effective_rank(mean_init) == pytest.approx(1.0, abs=1e-6)


def test_effective_rank_random_gaussian_close_to_full():
    rng = np.random.default_rng(1)
    n = 64
    er = G.effective_rank(rng.normal(size=(4096, n)))  # tall: singular values nearly equal
    assert 0.95 * n < er <= n
    # a square Gaussian spreads its singular values (quarter-circle law), still high rank
    er_sq = G.effective_rank(rng.normal(size=(n, n)))
    assert 0.7 * n < er_sq < n


def test_effective_rank_matches_definition_and_torch_input():
    s = np.array([3.0, 1.0, 0.0])
    p = np.array([0.75, 0.25])
    expected = math.exp(-(p * np.log(p)).sum())
    assert G.effective_rank(s=s) == pytest.approx(expected)
    assert G.effective_rank(np.zeros((3, 3))) == 0.0
    t = torch.diag(torch.tensor([3.0, 1.0, 0.0]))
    assert G.effective_rank(t) == pytest.approx(expected, rel=1e-6)
    summ = G.spectrum_summary(t)
    assert summ["singular_values"] == pytest.approx([3.0, 1.0, 0.0])
    assert summ["top1_share"] == pytest.approx(0.75)


def test_cosine_helpers_hand_cases():
    A = np.array([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])
    C = G.cosine_matrix(A)
    assert C == pytest.approx(np.array([[1, 0, -1], [0, 1, 0], [-1, 0, 1]]))
    # pairs: (0,1)=0, (0,2)=-1, (1,2)=0 -> mean -1/3
    assert G.mean_pairwise_cosine(A) == pytest.approx(-1 / 3)
    B = np.array([[1.0, 1.0]])
    # cos with [1,1]: 1/sqrt2, 1/sqrt2, -1/sqrt2 -> mean 1/(3 sqrt2)
    assert G.mean_cross_cosine(A, B) == pytest.approx(1 / (3 * math.sqrt(2)))
    assert math.isnan(G.mean_pairwise_cosine(A[:1]))
    assert G.mean_pairwise_cosine(np.ones((5, 3))) == pytest.approx(1.0)


def test_mean_cosines_match_brute_force():
    rng = np.random.default_rng(2)
    A, B = rng.normal(size=(30, 8)), rng.normal(size=(11, 8))
    C = G.cosine_matrix(A)
    brute = C[np.triu_indices(30, 1)].mean()
    assert G.mean_pairwise_cosine(A) == pytest.approx(brute)
    assert G.mean_cross_cosine(A, B) == pytest.approx(G.cosine_matrix(A, B).mean())


def test_block_contrast_detects_level_structure_and_matches_brute_force():
    rng = np.random.default_rng(3)
    sizes = [6, 4, 5]
    # each level clusters around its own direction -> strong block structure
    centers = rng.normal(size=(3, 16)) * 3
    E = np.concatenate([c + 0.3 * rng.normal(size=(k, 16)) for c, k in zip(centers, sizes)])
    out = G.block_contrast(E, sizes)
    C = G.cosine_matrix(E)
    lvl = np.repeat(np.arange(3), sizes)
    iu = np.triu_indices(len(E), 1)
    same = lvl[iu[0]] == lvl[iu[1]]
    assert out["within"] == pytest.approx(C[iu][same].mean())
    assert out["across"] == pytest.approx(C[iu][~same].mean())
    assert out["contrast"] > 0.5
    # shuffled rows: no level structure left
    shuffled = G.block_contrast(E[rng.permutation(len(E))], sizes)
    assert shuffled["contrast"] < out["contrast"] - 0.4
    with pytest.raises(ValueError):
        G.block_contrast(E, [6, 4])


def test_rsa_identical_is_one_and_permuted_is_lower():
    rng = np.random.default_rng(4)
    X = rng.normal(size=(20, 6))
    M = G.cosine_matrix(X)
    r = G.rsa(M, M)
    assert r["pearson"] == pytest.approx(1.0)
    assert r["spearman"] == pytest.approx(1.0)
    assert r["n_pairs"] == 190
    perm = rng.permutation(20)
    rp = G.rsa(M, M[perm][:, perm])
    assert rp["pearson"] < 0.5 and rp["spearman"] < 0.5
    # monotone transform: Spearman stays 1, Pearson drops below 1
    rm = G.rsa(M, np.exp(3 * M))
    assert rm["spearman"] == pytest.approx(1.0)
    assert rm["pearson"] < 0.999
    # constant matrix (mean init): undefined, reported as NaN
    assert math.isnan(G.rsa(M, np.ones_like(M))["pearson"])


def test_rsa_codes_per_level_and_overall():
    rng = np.random.default_rng(5)
    sizes = [8, 6]
    codes = [rng.normal(size=(8, 4)), rng.normal(size=(6, 4))]
    # learned rows = codes mapped linearly into a bigger space with an orthonormal map:
    # cosines preserved exactly -> RSA 1 per level and overall
    Q, _ = np.linalg.qr(rng.normal(size=(12, 4)))
    E = np.concatenate([c @ Q.T for c in codes])
    out = G.rsa_codes(codes, E, sizes)
    assert [lv["level"] for lv in out["per_level"]] == [0, 1]
    for lv in out["per_level"]:
        assert lv["pearson"] == pytest.approx(1.0) and lv["spearman"] == pytest.approx(1.0)
    assert out["overall"]["n_pairs"] == 28 + 15
    assert out["overall"]["pearson"] == pytest.approx(1.0)
    # scrambling level 1's rows breaks level 1 only
    E2 = E.copy()
    E2[8:] = E2[8:][rng.permutation(6)]
    out2 = G.rsa_codes(codes, E2, sizes)
    assert out2["per_level"][0]["pearson"] == pytest.approx(1.0)
    assert out2["per_level"][1]["pearson"] < 0.9
    assert out2["overall"]["pearson"] < 1.0
    # subsampling keeps the answer and caps the pairs
    sub = G.rsa_codes(codes, E, sizes, max_codes_per_level=4)
    assert sub["overall"]["n_pairs"] == 6 + 6
    assert sub["overall"]["pearson"] == pytest.approx(1.0)


def test_subsample_levels_keeps_order_and_budget():
    idx, kept = G.subsample_levels([100, 50, 10], 32)
    assert len(idx) == sum(kept) <= 34
    assert np.all(np.diff(idx) > 0)
    assert kept[0] > kept[1] > kept[2] >= 1
    idx_all, kept_all = G.subsample_levels([3, 2], 10)
    assert idx_all.tolist() == [0, 1, 2, 3, 4] and kept_all == [3, 2]


def test_diagnose_mean_init_vs_spread():
    rng = np.random.default_rng(6)
    sizes = [8, 8]
    codes = [rng.normal(size=(8, 4)), rng.normal(size=(8, 4))]
    text = rng.normal(size=(30, 12))
    mean_rows = np.tile(text.mean(0, keepdims=True), (16, 1))
    d0 = G.diagnose(mean_rows, sizes, codes, text)
    assert d0["effective_rank"] == pytest.approx(1.0, abs=1e-6)
    assert d0["mean_cosine_new"] == pytest.approx(1.0)
    assert math.isnan(d0["rsa"]["overall"]["pearson"])
    spread = rng.normal(size=(16, 12))
    d1 = G.diagnose(spread, sizes, codes, text)
    assert d1["effective_rank"] > 8
    assert len(d1["singular_values"]) == 12
    assert set(d1) >= {"block", "rsa", "mean_cosine_new_text", "per_level_effective_rank"}


# --------------------------------------------------------------------------- bootstrap CIs
def test_bootstrap_rsa_overall_perfect_and_unrelated():
    rng = np.random.default_rng(0)
    codes = [rng.normal(size=(16, 4)), rng.normal(size=(16, 4))]
    Q = np.linalg.qr(rng.normal(size=(8, 8)))[0][:4]  # [4, 8] with orthonormal rows
    same = np.concatenate([c @ Q for c in codes])  # cosines preserved exactly
    boot = G.bootstrap_rsa_overall(codes, same, [16, 16], n_boot=20, seed=1)
    assert len(boot["pearson"]) == 20 and np.allclose(boot["pearson"], 1.0)
    noise = rng.normal(size=(32, 8))
    boot = G.bootstrap_rsa_overall(codes, noise, [16, 16], n_boot=200, seed=1)
    point = G.rsa_codes(codes, noise, [16, 16])["overall"]["pearson"]
    lo, hi = np.percentile(boot["pearson"], [2.5, 97.5])
    assert lo < point < hi and hi - lo > 0.05


def test_diagnose_stores_replicates_only_when_asked():
    rng = np.random.default_rng(0)
    E = rng.normal(size=(8, 6))
    codes = [rng.normal(size=(4, 3)), rng.normal(size=(4, 3))]
    d = G.diagnose(E, [4, 4], code_vectors=codes, n_boot=10)
    assert len(d["rsa"]["overall"]["pearson_boot"]) == 10
    assert "effective_rank_boot" not in d  # biased by repeated rows: seeds give its CI
    d0 = G.diagnose(E, [4, 4], code_vectors=codes, n_boot=0)
    assert "pearson_boot" not in d0["rsa"]["overall"]


def test_row_shift_hand_case_and_unmoved_rows():
    before = np.ones((4, 3))  # mean init: all rows equal, effective rank 1
    after = before.copy()
    after[0] += [3.0, 4.0, 0.0]  # moved 5
    after[1] += [0.0, 0.0, 1.0]  # moved 1
    old = np.full((2, 3), 2.0)  # norm 2 * sqrt(3)
    r = G.row_shift(before, torch.tensor(after), old)
    assert r["moved_mean"] == pytest.approx(1.5) and r["moved_max"] == pytest.approx(5.0)
    assert r["moved_rel"] == pytest.approx(1.5 / (2 * math.sqrt(3)))
    assert r["effective_rank_before"] == pytest.approx(1.0) and r["effective_rank_after"] > 1.5
    still = G.row_shift(before, before)
    assert still["moved_mean"] == 0.0 and still["moved_rel"] is None
    assert still["effective_rank_after"] == pytest.approx(still["effective_rank_before"])
    with pytest.raises(ValueError, match="same"):
        G.row_shift(before, after[:3])
