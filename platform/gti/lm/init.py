"""Initialisation arms for the new SID-token rows: one function, chosen by `init.method`.

What it is for: `init_rows(method, old_embeddings, n_new, ...) -> Tensor[V_new, d]` so that a
comparison between arms differs only in the config key. Arms: `mean`, `mean_noise`, `random`,
`description` and `codebook`; each is defined where it is computed (`init_rows`,
`_description_rows`, `_codebook_rows`). `old_embeddings` [V_real, d] must be the REAL tokenizer
rows (never padding rows of a matrix padded past its tokenizer), so the vocabulary statistics are
those of actual tokens.

What it does NOT know: tokenizers, models, or where rows go (see `gti.lm.new_rows`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from gti.common.errors import ConfigError

from gti.common.arms import INIT_METHODS


def _level_offsets(codebook_sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for k in codebook_sizes:
        out.append(acc)
        acc += int(k)
    return out


def vocab_stats(old: Tensor) -> dict[str, Tensor]:
    """mean [d], per-dim std [d], mean row norm (scalar), mean distance from the mean (scalar)."""
    old = old.to(torch.float32)
    mean = old.mean(0)
    return {
        "mean": mean,
        "std": old.std(0, unbiased=False),
        "row_norm": old.norm(dim=1).mean(),
        "spread": (old - mean).norm(dim=1).mean(),
    }


def _description_rows(old: Tensor, n_sid: int, item_codes: Tensor, item_token_ids: Sequence[Sequence[int]],
                      codebook_sizes: Sequence[int], mean: Tensor) -> Tensor:
    """Rows [n_sid, d]: token-weighted mean embedding of the texts of the items with each code
    at its level (sum of token embeddings / number of tokens); a code no item carries gets the
    vocabulary mean."""
    item_codes = torch.as_tensor(item_codes, dtype=torch.long)
    n_items, levels = item_codes.shape
    if len(item_token_ids) != n_items:
        raise ConfigError(f"init.method=description: {len(item_token_ids)} item texts for {n_items} items")
    if levels != len(codebook_sizes):
        raise ConfigError(
            f"init.method=description: codes have {levels} levels, codebook_sizes {list(codebook_sizes)}"
        )
    d = old.shape[1]
    # Per item: sum of its token embeddings [N, d] and token count [N].
    sums = torch.zeros(n_items, d, dtype=torch.float64)
    counts = torch.zeros(n_items, dtype=torch.float64)
    for i, ids in enumerate(item_token_ids):
        if len(ids):
            idx = torch.as_tensor(list(ids), dtype=torch.long)
            if int(idx.max()) >= old.shape[0] or int(idx.min()) < 0:
                raise ConfigError(f"init.method=description: item row {i} has a token id outside the vocabulary")
            sums[i] = old[idx].to(torch.float64).sum(0)
            counts[i] = len(ids)
    rows_sum = torch.zeros(n_sid, d, dtype=torch.float64)
    rows_cnt = torch.zeros(n_sid, dtype=torch.float64)
    offsets = torch.as_tensor(_level_offsets(codebook_sizes), dtype=torch.long)
    tok_rows = item_codes + offsets.unsqueeze(0)  # [N, L] new-row index of each item's code
    if int(tok_rows.max()) >= n_sid:
        raise ConfigError("init.method=description: a code is outside its level's codebook size")
    for lvl in range(levels):
        rows_sum.index_add_(0, tok_rows[:, lvl], sums)
        rows_cnt.index_add_(0, tok_rows[:, lvl], counts)
    out = mean.to(torch.float64).expand(n_sid, d).clone()
    have = rows_cnt > 0
    out[have] = rows_sum[have] / rows_cnt[have].unsqueeze(1)
    return out.to(torch.float32)


def _codebook_rows(old: Tensor, codebooks: Sequence[Tensor], stats: dict[str, Tensor]) -> Tensor:
    """Rows [sum K_l, d]: each level's code vectors mapped onto the vocabulary's top principal
    directions, centred on the vocabulary mean, at the vocabulary's spread.

    `codebook`: the RQ-VAE code vectors of each level mapped into the LM space by an orthonormal
    map onto the vocabulary's top principal directions. Per level: centre the code vectors,
    project them through P [code_dim, d] (rows = the first code_dim right singular vectors of the
    centred vocabulary; if code_dim > d, the codes are first reduced to their own top-d
    principal components), scale them so their mean norm equals the vocabulary's mean distance
    from its mean, and add the vocabulary mean. An orthonormal P preserves the code geometry
    exactly (distances up to one scale per level), so RSA against the codebooks starts at 1;
    scaling per level keeps residual levels (whose code vectors shrink geometrically) as
    distinguishable as the first. The PCA basis puts the new rows in directions the LM already
    uses rather than arbitrary ones. A de-duplication level without code vectors keeps the mean.
    """
    old = old.to(torch.float32)
    d = old.shape[1]
    centred = old - stats["mean"]
    # Right singular vectors of the centred vocabulary = its principal directions [r, d].
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    blocks = []
    for lvl, cb in enumerate(codebooks):
        c = torch.as_tensor(cb, dtype=torch.float32)
        if c.ndim != 2:
            raise ConfigError(f"init.method=codebook: codebook level {lvl} is not a [K, code_dim] matrix")
        c = c - c.mean(0)
        k = c.shape[1]
        if k > min(d, vh.shape[0]):
            # Reduce the codes to their own top principal components first (an isometry on
            # the span of the data when its rank fits).
            k = min(d, vh.shape[0])
            _, _, vc = torch.linalg.svd(c, full_matrices=False)
            c = c @ vc[:k].T
        proj = c @ vh[:k]  # [K, d]; vh rows are orthonormal, so distances are preserved
        norm = proj.norm(dim=1).mean()
        scale = stats["spread"] / norm if norm > 0 else torch.tensor(0.0)
        blocks.append(stats["mean"] + proj * scale)
    return torch.cat(blocks, 0)


def init_rows(
    method: str,
    old_embeddings: Tensor,
    n_new: int,
    *,
    noise_std: float = 0.02,
    generator: torch.Generator | None = None,
    item_codes: Tensor | None = None,
    item_token_ids: Sequence[Sequence[int]] | None = None,
    codebook_sizes: Sequence[int] | None = None,
    codebooks: Sequence[Tensor] | None = None,
) -> Tensor:
    """Initial new rows, float32 [n_new, d], for `method` in INIT_METHODS: `mean` (Hewitt's
    mean of the vocabulary, every new row the same vector), `mean_noise` (mean + N(0, (noise_std
    * sigma_j)^2) per dimension j, sigma_j the vocabulary's per-dimension std), `random`
    (isotropic random directions at the vocabulary's mean row norm), `description`
    (`_description_rows`), `codebook` (`_codebook_rows`).

    old_embeddings: [V_real, d], the real tokenizer rows (no padding rows).
    n_new: number of new rows (SID tokens + markers, if any). Rows follow the codec's token
        order (level-major, then code); rows past the SID tokens (markers) get the vocabulary
        mean.
    noise_std: `mean_noise` std relative to the per-dimension vocabulary std.
    generator: torch.Generator for `mean_noise` / `random` (deterministic per seed).
    item_codes: LongTensor[N_items, L] codes per item (`description`).
    item_token_ids: per item, the token ids of its text (title + description or pseudo-text).
    codebook_sizes: codes per level [L] (`description`, `codebook`); SID rows = sum of them.
    codebooks: per level, code vectors [K_l, code_dim] (`codebook`).
    """
    if method not in INIT_METHODS:
        raise ConfigError(f"init.method '{method}' is not one of {list(INIT_METHODS)}")
    old = old_embeddings.detach().to("cpu", torch.float32)
    if old.ndim != 2 or old.shape[0] < 2:
        raise ConfigError("init: the vocabulary matrix must be [V_real >= 2, d]")
    d = old.shape[1]
    st = vocab_stats(old)
    out = st["mean"].expand(n_new, d).clone()
    if method == "mean":
        return out
    if method == "mean_noise":
        noise = torch.randn(n_new, d, generator=generator)
        return out + noise * (noise_std * st["std"])
    if method == "random":
        r = torch.randn(n_new, d, generator=generator)
        return r / r.norm(dim=1, keepdim=True) * st["row_norm"]
    if codebook_sizes is None and codebooks is not None:
        codebook_sizes = [int(torch.as_tensor(c).shape[0]) for c in codebooks]
    if codebook_sizes is None:
        raise ConfigError(f"init.method={method} needs the codebook sizes (sid manifest)")
    n_sid = int(sum(codebook_sizes))
    if n_sid > n_new:
        raise ConfigError(f"init.method={method}: {n_sid} SID rows but only {n_new} new rows")
    if method == "description":
        if item_codes is None or item_token_ids is None:
            raise ConfigError("init.method=description needs item codes and item texts")
        out[:n_sid] = _description_rows(old, n_sid, item_codes, item_token_ids, codebook_sizes, st["mean"])
        return out
    # codebook
    if codebooks is None:
        raise ConfigError("init.method=codebook needs the RQ-VAE codebooks (sid/codebooks.safetensors)")
    sizes = [int(k) for k in codebook_sizes]
    if [int(torch.as_tensor(c).shape[0]) for c in codebooks] != sizes[: len(codebooks)]:
        raise ConfigError("init.method=codebook: codebook shapes do not match sid codebook_sizes")
    # A de-duplication level added after quantisation has no code vectors: its rows keep the mean.
    n_cb = sum(sizes[: len(codebooks)])
    out[:n_cb] = _codebook_rows(old, codebooks, st)
    return out
