"""Residual k-means quantiser (`sid.method: rqkmeans`), optionally with balanced clusters.

What it is for: an encoder-free alternative to the RQ-VAE. Level 0 runs k-means on the item
embeddings [N, D], level l on what levels < l leave over; the codebooks live in the embedding
space itself. With `balanced` (`gti.sid.kmeans.balanced_kmeans`), plain Lloyd steps are
followed by Sinkhorn-balanced ones, so codes receive about N/K items each (fewer collisions,
flatter usage).

What it does not know: collision handling (`gti.sid.resolve`), training loops, Ray. It offers
the same quantiser interface as `gti.sid.rqvae.RQVAE` (encode, last_residual, decode_codes,
level_codebooks, levels, codebook_sizes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from gti.sid.kmeans import kmeans, row_argmin


@dataclass
class RQKMeansConfig:
    in_dim: int
    levels: int = 4
    codebook_size: int = 256
    balanced: bool = True
    sinkhorn_epsilon: float = 0.003  # SidConfig.kmeans_sinkhorn_epsilon
    sinkhorn_iters: int = 50

    @classmethod
    def from_sid_config(cls, sid_cfg, in_dim: int) -> "RQKMeansConfig":
        return cls(
            in_dim=in_dim,
            levels=sid_cfg.levels,
            codebook_size=sid_cfg.codebook_size,
            balanced=sid_cfg.balanced,
            sinkhorn_epsilon=sid_cfg.kmeans_sinkhorn_epsilon,
            sinkhorn_iters=sid_cfg.sinkhorn_iters,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class ResidualKMeans(nn.Module):
    """Codebooks [L, K, in_dim] fitted by residual k-means (see module docstring)."""

    method = "rqkmeans"

    def __init__(self, cfg: RQKMeansConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("codebooks", torch.zeros(cfg.levels, cfg.codebook_size, cfg.in_dim))

    @property
    def levels(self) -> int:
        return self.cfg.levels

    @property
    def codebook_sizes(self) -> list[int]:
        return [self.cfg.codebook_size] * self.cfg.levels

    def level_codebooks(self) -> list[torch.Tensor]:
        return [cb for cb in self.codebooks]

    @torch.no_grad()
    def fit(self, x: torch.Tensor, iters: int = 25, generator: torch.Generator | None = None,
            log=None) -> list[float]:
        """Fit on x [N, D]; returns the mean squared residual after each level."""
        res = x.float()
        inertias = []
        for lv in range(self.levels):
            km = kmeans(res, self.cfg.codebook_size, iters=iters, generator=generator,
                        balanced=self.cfg.balanced, sinkhorn_epsilon=self.cfg.sinkhorn_epsilon,
                        sinkhorn_iters=self.cfg.sinkhorn_iters)
            self.codebooks[lv] = km.centroids
            res = res - km.centroids[km.assign]
            inertias.append(km.inertia)
            if log is not None:
                log(f"rqkmeans level {lv}: inertia {km.inertia:.4g} after {km.iters} iterations")
        return inertias

    def _greedy(self, x: torch.Tensor, stop_before_last: bool = False):
        cb_sq = (self.codebooks * self.codebooks).sum(-1)
        res = x.float()
        codes = torch.empty(x.shape[0], self.levels, dtype=torch.long, device=x.device)
        for lv in range(self.levels):
            if stop_before_last and lv == self.levels - 1:
                break
            # Nearest centroid; |r|^2 is constant per row so it is left out.
            idx = row_argmin(torch.addmm(cb_sq[lv].unsqueeze(0), res, self.codebooks[lv].T, alpha=-2.0))
            codes[:, lv] = idx
            res = res - self.codebooks[lv][idx]
        return codes, res

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy codes LongTensor[N, L]."""
        return self._greedy(x)[0]

    @torch.no_grad()
    def last_residual(self, x: torch.Tensor) -> torch.Tensor:
        """Input of the last level, [N, D]."""
        return self._greedy(x, stop_before_last=True)[1]

    @torch.no_grad()
    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        return self.codebooks[torch.arange(self.levels).unsqueeze(0), codes].sum(1)
