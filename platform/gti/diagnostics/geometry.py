"""Geometry of the new-token embedding matrix E_new: spectra, cosines, block structure, RSA.

What it is for: the numbers behind the paper's geometric evidence, computed from plain arrays
at initialisation, after grounding and after SFT: singular values and effective rank, how far
training moved the new rows, mean cosines (among new rows, against old rows), within- vs
across-level block contrast, and RSA against the RQ-VAE code vectors; `diagnose` gathers them
for one snapshot. SID rows are assumed level-major (the order of the `sid` stage's
`new_tokens`); the caller selects them (`gti.stages.report`).

What it does not know: where the arrays come from (files, models, Ray) or how they are plotted.
Everything is computed in float64 numpy; an undefined statistic (e.g. RSA of a mean-initialised
matrix whose rows are all equal) is NaN, never a made-up number.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from scipy import stats

_EPS = 1e-12


def as_array(x: Any) -> np.ndarray:
    """float64 numpy copy of a numpy array or torch tensor (any device, any dtype)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().to("cpu").float().numpy()
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------- spectrum
def singular_values(E: Any) -> np.ndarray:
    """Singular values of E [n, d], descending, shape [min(n, d)]."""
    A = as_array(E)
    if A.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {A.shape}")
    if A.size == 0:
        return np.zeros(0)
    return np.linalg.svd(A, compute_uv=False)


def effective_rank(E: Any = None, *, s: Any = None) -> float:
    """Effective rank of E [n, d] (or of given singular values `s`).

    Definition (Roy & Vetterli 2007): with singular values s_1..s_k (k = min(n, d)) and
    p_i = s_i / sum_j s_j, erank = exp(-sum_i p_i log p_i), terms with p_i = 0 counted as 0.
    The matrix is NOT centred (mean initialisation must come out as rank 1, the point the paper
    makes). 1 <= erank <= k; a zero matrix has erank 0 by convention.
    """
    sv = singular_values(E) if s is None else np.asarray(s, dtype=np.float64)
    total = float(sv.sum())
    if total <= 0:
        return 0.0
    p = sv / total
    p = p[p > 0]
    return float(math.exp(-float(np.sum(p * np.log(p)))))


def row_shift(before: Any, after: Any, old: Any | None = None) -> dict[str, float | None]:
    """How far training moved the new rows: `before`, `after` [V_new, d] (same rows, same
    order), `old` [V_old, d] the model's existing rows (for scale), or None.

    {"moved_mean": mean_i ||after_i - before_i||, "moved_max": max_i of the same,
     "moved_rel": moved_mean / mean_j ||old_j|| (None without `old`): 1.0 means the rows moved,
     on average, as far as an old row is long,
     "effective_rank_before", "effective_rank_after"}. The grounding stage records it, so a
    grounding that did nothing shows moved_mean 0 and an unchanged effective rank."""
    b, a = as_array(before), as_array(after)
    if b.shape != a.shape or b.ndim != 2:
        raise ValueError(f"row_shift: before {b.shape} and after {a.shape} must be the same [n, d] shape")
    dist = np.linalg.norm(a - b, axis=1) if b.size else np.zeros(0)
    moved = float(dist.mean()) if dist.size else 0.0
    rel = None
    if old is not None:
        scale = float(np.linalg.norm(as_array(old), axis=1).mean())
        rel = moved / scale if scale > 0 else None
    return {"moved_mean": moved, "moved_max": float(dist.max()) if dist.size else 0.0, "moved_rel": rel,
            "effective_rank_before": effective_rank(b), "effective_rank_after": effective_rank(a)}


def spectrum_summary(E: Any) -> dict[str, Any]:
    """Singular values [k] (as a list), effective rank and the share of the top value."""
    sv = singular_values(E)
    total = float(sv.sum())
    return {
        "singular_values": [float(v) for v in sv],
        "effective_rank": effective_rank(s=sv),
        "top1_share": float(sv[0] / total) if total > 0 else float("nan"),
        "shape": list(as_array(E).shape),
    }


# --------------------------------------------------------------------------- cosine
def normalize_rows(A: Any) -> np.ndarray:
    """Rows of A [n, d] scaled to unit L2 norm (zero rows stay zero)."""
    X = as_array(A)
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    return X / np.maximum(norms, _EPS)


def cosine_matrix(A: Any, B: Any | None = None) -> np.ndarray:
    """Cosine similarities [n, m] between rows of A [n, d] and rows of B [m, d] (B = A if None)."""
    U = normalize_rows(A)
    V = U if B is None else normalize_rows(B)
    return U @ V.T


def mean_pairwise_cosine(A: Any) -> float:
    """Mean cosine over unordered pairs i < j of rows of A [n, d]; NaN when n < 2.

    Computed in O(n d) from the sum of unit rows: sum_{i != j} u_i.u_j = |sum u|^2 - sum |u_i|^2,
    so the 24k x 24k matrix of an industrial vocabulary is never formed.
    """
    U = normalize_rows(A)
    n = U.shape[0]
    if n < 2:
        return float("nan")
    s = U.sum(axis=0)
    sq = float(np.sum(U * U))  # = n unless some rows are zero
    return float((s @ s - sq) / (n * (n - 1)))


def mean_cross_cosine(A: Any, B: Any) -> float:
    """Mean cosine over all pairs (row of A [n, d], row of B [m, d]); NaN if either is empty."""
    U, V = normalize_rows(A), normalize_rows(B)
    if U.shape[0] == 0 or V.shape[0] == 0:
        return float("nan")
    return float(U.sum(axis=0) @ V.sum(axis=0) / (U.shape[0] * V.shape[0]))


# --------------------------------------------------------------------------- levels
def level_slices(codebook_sizes: Sequence[int]) -> list[slice]:
    """Row slices of each level in a level-major SID matrix: sizes [4, 3] -> [0:4], [4:7]."""
    out, start = [], 0
    for k in codebook_sizes:
        out.append(slice(start, start + int(k)))
        start += int(k)
    return out


def subsample_levels(codebook_sizes: Sequence[int], max_tokens: int) -> tuple[np.ndarray, list[int]]:
    """Evenly spaced row indices, at most `max_tokens` in all, kept in level-major order.

    Each level keeps a share proportional to its size (at least one row). Returns the indices
    into the full level-major matrix and the number kept per level (for drawing boundaries).
    """
    sizes = [int(k) for k in codebook_sizes]
    total = sum(sizes)
    if total <= max_tokens:
        return np.arange(total), sizes
    idx, kept = [], []
    for sl, k in zip(level_slices(sizes), sizes):
        m = max(1, min(k, int(round(max_tokens * k / total))))
        idx.append(sl.start + np.unique(np.linspace(0, k - 1, m).round().astype(int)))
        kept.append(len(idx[-1]))
    return np.concatenate(idx), kept


def block_contrast(E_sid: Any, codebook_sizes: Sequence[int]) -> dict[str, float]:
    """Within-level vs across-level cosine of SID rows E_sid [sum(codebook_sizes), d].

    within = mean cosine over all pairs (i < j) of rows of the same level, pooled over levels;
    across = mean cosine over all pairs of rows of different levels; contrast = within - across.
    A positive contrast is block structure along the diagonal of the level-ordered SID-SID map.
    Computed from per-level sums of unit rows in O(V d). NaN when a term has no pairs.
    """
    U = normalize_rows(E_sid)
    sizes = [int(k) for k in codebook_sizes]
    if U.shape[0] != sum(sizes):
        raise ValueError(f"E_sid has {U.shape[0]} rows, codebook_sizes sum to {sum(sizes)}")
    sums = [U[sl].sum(axis=0) for sl in level_slices(sizes)]
    sqs = [float(np.sum(U[sl] * U[sl])) for sl in level_slices(sizes)]
    within_sum = sum(float(s @ s) - q for s, q in zip(sums, sqs)) / 2.0
    within_pairs = sum(k * (k - 1) / 2 for k in sizes)
    total = sum(sums) if sums else np.zeros(U.shape[1])
    all_pairs_sum = (float(total @ total) - sum(sqs)) / 2.0
    across_sum = all_pairs_sum - within_sum
    n = sum(sizes)
    across_pairs = n * (n - 1) / 2 - within_pairs
    within = within_sum / within_pairs if within_pairs else float("nan")
    across = across_sum / across_pairs if across_pairs else float("nan")
    return {"within": float(within), "across": float(across), "contrast": float(within - across)}


# --------------------------------------------------------------------------- RSA
def upper_triangle(M: Any) -> np.ndarray:
    """Entries above the diagonal of a square matrix M [n, n], row-major, shape [n(n-1)/2]."""
    A = as_array(M)
    if A.ndim != 2 or A.shape[0] != A.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {A.shape}")
    return A[np.triu_indices(A.shape[0], k=1)]


def _corr(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    if a.size < 2 or np.ptp(a) <= _EPS or np.ptp(b) <= _EPS:
        return float("nan"), float("nan")  # a constant vector has no correlation
    pearson = float(np.corrcoef(a, b)[0, 1])
    spearman = float(stats.spearmanr(a, b).statistic)  # average ranks for ties
    return pearson, spearman


def rsa(M1: Any, M2: Any) -> dict[str, float]:
    """Pearson and Spearman correlation of the upper triangles of two similarity matrices [n, n]."""
    a, b = upper_triangle(M1), upper_triangle(M2)
    if a.shape != b.shape:
        raise ValueError(f"RSA needs matrices of the same size, got {as_array(M1).shape} and {as_array(M2).shape}")
    p, s = _corr(a, b)
    return {"pearson": p, "spearman": s, "n_pairs": int(a.size)}


def rsa_codes(
    code_vectors: Sequence[Any],
    E_sid: Any,
    codebook_sizes: Sequence[int],
    max_codes_per_level: int | None = None,
) -> dict[str, Any]:
    """RSA between RQ-VAE code vectors and learned SID embeddings, per level and overall.

    code_vectors: one array [K_l, code_dim] per level that has code vectors (the `sid` stage's
    codebooks.safetensors `level_l`); a dedup level without vectors is simply not passed.
    E_sid: SID rows of E_new [sum(codebook_sizes), d], level-major.

    How levels are compared: the code vectors of different levels live in different residual
    spaces (level l quantises what levels < l left over), so a cosine between a level-0 and a
    level-1 code vector means nothing. RSA is therefore computed per level l, on the
    K_l x K_l cosine matrices of level l's code vectors and of level l's SID rows. "overall"
    uses only the block diagonal: the within-level upper triangles of all levels are
    concatenated (for both sides) and correlated once, so it weights levels by their number of
    pairs. `max_codes_per_level` keeps an evenly spaced subset of each level (the K x K matrix
    of an 8,192-code level would be 67M entries).
    """
    sizes = [int(k) for k in codebook_sizes]
    E = as_array(E_sid)
    if E.shape[0] != sum(sizes):
        raise ValueError(f"E_sid has {E.shape[0]} rows, codebook_sizes sum to {sum(sizes)}")
    per_level, code_parts, emb_parts = [], [], []
    for lvl, (cv, sl) in enumerate(zip(code_vectors, level_slices(sizes))):
        C = as_array(cv)
        if C.shape[0] != sizes[lvl]:
            raise ValueError(f"level {lvl}: {C.shape[0]} code vectors but codebook size {sizes[lvl]}")
        keep = np.arange(C.shape[0])
        if max_codes_per_level and C.shape[0] > max_codes_per_level:
            keep = np.unique(np.linspace(0, C.shape[0] - 1, max_codes_per_level).round().astype(int))
        a = upper_triangle(cosine_matrix(C[keep]))
        b = upper_triangle(cosine_matrix(E[sl][keep]))
        p, s = _corr(a, b)
        per_level.append({"level": lvl, "pearson": p, "spearman": s, "n_pairs": int(a.size)})
        code_parts.append(a)
        emb_parts.append(b)
    if code_parts:
        a, b = np.concatenate(code_parts), np.concatenate(emb_parts)
        p, s = _corr(a, b)
        overall = {"pearson": p, "spearman": s, "n_pairs": int(a.size)}
    else:
        overall = {"pearson": float("nan"), "spearman": float("nan"), "n_pairs": 0}
    return {"per_level": per_level, "overall": overall}


# --------------------------------------------------------------------------- bootstrap CIs
def bootstrap_rsa_overall(
    code_vectors: Sequence[Any],
    E_sid: Any,
    codebook_sizes: Sequence[int],
    n_boot: int = 200,
    seed: int = 0,
    max_codes_per_level: int = 256,
) -> dict[str, list[float]]:
    """Replicates of `rsa_codes(...)["overall"]` Pearson and Spearman under resampling of the
    codes within each level (with replacement), {"pearson": [n_boot], "spearman": [n_boot]}.

    Pairs of a code with a copy of itself are dropped (both cosines would be 1 and inflate the
    correlation). At most `max_codes_per_level` evenly spaced codes per level enter (Spearman on
    millions of pairs, 200 times, would cost minutes); the point estimate stays `rsa_codes`'.
    """
    sizes = [int(k) for k in codebook_sizes]
    E = as_array(E_sid)
    mats = []
    for lvl, (cv, sl) in enumerate(zip(code_vectors, level_slices(sizes))):
        C = as_array(cv)
        keep = np.arange(C.shape[0])
        if C.shape[0] > max_codes_per_level:
            keep = np.unique(np.linspace(0, C.shape[0] - 1, max_codes_per_level).round().astype(int))
        mats.append((cosine_matrix(C[keep]), cosine_matrix(E[sl][keep])))
    out: dict[str, list[float]] = {"pearson": [], "spearman": []}
    if not mats or n_boot < 1:
        return out
    rng = np.random.default_rng(seed)
    for _ in range(n_boot):
        a_parts, b_parts = [], []
        for Ca, Cb in mats:
            k = Ca.shape[0]
            idx = rng.integers(0, k, k)
            iu = np.triu_indices(k, k=1)
            distinct = idx[iu[0]] != idx[iu[1]]
            a_parts.append(Ca[np.ix_(idx, idx)][iu][distinct])
            b_parts.append(Cb[np.ix_(idx, idx)][iu][distinct])
        p, s = _corr(np.concatenate(a_parts), np.concatenate(b_parts))
        out["pearson"].append(p)
        out["spearman"].append(s)
    return out


# --------------------------------------------------------------------------- all at once
def diagnose(
    e_sid: Any,
    codebook_sizes: Sequence[int],
    code_vectors: Sequence[Any] | None = None,
    text_rows: Any | None = None,
    e_new: Any | None = None,
    max_codes_per_level: int | None = 1024,
    n_boot: int = 200,
    boot_seed: int = 0,
) -> dict[str, Any]:
    """Every diagnostic of one snapshot of E_new, as a JSON-ready dict (NaN for undefined).

    With `n_boot` > 0 it also holds bootstrap replicates for the report's RSA CIs:
    `rsa.overall.{pearson,spearman}_boot` [n_boot] (codes resampled within levels; see
    `bootstrap_rsa_overall`). The effective rank gets no row bootstrap: resampling rows with
    replacement repeats rows, and repeated rows lower the rank (a 108-row matrix of erank 47
    resamples to 27-32), so its CI comes from the spread over seeds (the report).

    e_sid: SID rows [sum(codebook_sizes), d] (level-major); e_new: all new rows [V_new, d]
    (defaults to e_sid; markers included when present) -- the spectrum is of e_new;
    code_vectors: per-level RQ-VAE code vectors for RSA; text_rows: a sample of old vocabulary
    rows [m, d] of the same model for the SID-text cosine.
    """
    full = e_sid if e_new is None else e_new
    spec = spectrum_summary(full)
    out: dict[str, Any] = {
        "effective_rank": spec["effective_rank"],
        "singular_values": spec["singular_values"],
        "top1_share": spec["top1_share"],
        "shape": spec["shape"],
        "mean_cosine_new": mean_pairwise_cosine(e_sid),
        "block": block_contrast(e_sid, codebook_sizes),
        "per_level_effective_rank": [
            effective_rank(as_array(e_sid)[sl]) for sl in level_slices(codebook_sizes)
        ],
    }
    if text_rows is not None:
        out["mean_cosine_new_text"] = mean_cross_cosine(e_sid, text_rows)
        out["mean_cosine_text"] = mean_pairwise_cosine(text_rows)
    if code_vectors is not None:
        n = len(code_vectors)
        out["rsa"] = rsa_codes(
            code_vectors, as_array(e_sid)[: sum(codebook_sizes[:n])], codebook_sizes[:n],
            max_codes_per_level=max_codes_per_level,
        )
        if n_boot > 0:
            boot = bootstrap_rsa_overall(
                code_vectors, as_array(e_sid)[: sum(codebook_sizes[:n])], codebook_sizes[:n],
                n_boot=n_boot, seed=boot_seed,
            )
            out["rsa"]["overall"]["pearson_boot"] = boot["pearson"]
            out["rsa"]["overall"]["spearman_boot"] = boot["spearman"]
    return out
