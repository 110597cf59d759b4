"""Residual-quantisation VAE (RQ-VAE) for semantic IDs, as a plain torch module.

What it is for: mapping item content embeddings x [N, D] to L discrete codes per item. An MLP
encoder gives z [N, code_dim]; L codebooks [K, code_dim] quantise z residually (level l picks the
code nearest to what levels < l left over); an MLP decoder reconstructs x from the sum of the
chosen code vectors. Training choices are on `RQVAE`; measured in bench/sid/RESULTS.md,
"Semantic IDs". Shares the quantiser interface of `gti.sid.quantizer` with residual k-means.

What it does not know: data loading, distributed training (the `sid` stage's worker loop
all-reduces usage counts and broadcasts revived codes), collision handling (`gti.sid.resolve`),
Ray.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gti.common.devices import native_bf16
from gti.sid.balance import sinkhorn_assign
from gti.sid.kmeans import kmeans, row_argmin


ENCODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_encode_dtype(setting: str, device: str = "cpu") -> str:
    """`sid.assign_dtype` -> encode_dtype: "auto" is bfloat16 where it is native, else float32.

    bf16 changes the greedy code of some items whose two nearest codes are near-equidistant
    for equally good ones: recon MSE, utilisation and collisions were unchanged on the bench's
    MiniLM set (bench/sid/RESULTS.md, "Semantic IDs").
    """
    if setting == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if setting not in ENCODE_DTYPES:
        raise ValueError(f"sid.assign_dtype must be auto, float32 or bfloat16, got {setting!r}")
    return setting


@dataclass
class RQVAEConfig:
    in_dim: int
    encoder_dims: list[int] = field(default_factory=lambda: [512, 256])
    code_dim: int = 32
    levels: int = 4
    codebook_size: int = 256
    dropout: float = 0.1
    beta: float = 0.25
    rotation_trick: bool = False
    diversity_weight: float = 0.0
    train_sinkhorn_epsilon: float = 0.0  # > 0: the last levels train on balanced (Sinkhorn) codes
    train_sinkhorn_iters: int = 50
    train_sinkhorn_levels: int = 1  # how many of the last levels (1: the last only, as LC-Rec)
    # Precision of the encoder MLP in `encode` / `last_residual` ("float32" or "bfloat16");
    # the nearest-code search is float32 either way. Saved with the model, so every later
    # re-encoding uses the precision the catalog was assigned with.
    encode_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.encode_dtype not in ENCODE_DTYPES:
            raise ValueError(f"encode_dtype must be one of {sorted(ENCODE_DTYPES)}, got {self.encode_dtype!r}")

    @classmethod
    def from_sid_config(cls, sid_cfg, in_dim: int) -> "RQVAEConfig":
        return cls(
            in_dim=in_dim,
            encoder_dims=list(sid_cfg.encoder_dims),
            code_dim=sid_cfg.code_dim,
            levels=sid_cfg.levels,
            codebook_size=sid_cfg.codebook_size,
            dropout=sid_cfg.dropout,
            beta=sid_cfg.commitment_beta,
            rotation_trick=sid_cfg.rotation_trick,
            diversity_weight=sid_cfg.diversity_weight,
            train_sinkhorn_epsilon=sid_cfg.train_sinkhorn_epsilon,
            train_sinkhorn_iters=sid_cfg.sinkhorn_iters,
            train_sinkhorn_levels=(sid_cfg.levels if sid_cfg.train_sinkhorn_levels == "all"
                                   else sid_cfg.train_sinkhorn_levels),
        )

    def to_dict(self) -> dict:
        return asdict(self)


def mlp(dims: list[int], dropout: float) -> nn.Sequential:
    """Dropout -> Linear -> ReLU blocks; no activation after the last Linear. Linear weights
    Xavier-normal, biases zero (as the reference RQ-VAE code does): with PyTorch's default init
    the encoder's outputs start small and levels 2-4 use far fewer codes."""
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        if dropout > 0:
            mods.append(nn.Dropout(dropout))
        lin = nn.Linear(a, b)
        nn.init.xavier_normal_(lin.weight)
        nn.init.zeros_(lin.bias)
        mods.append(lin)
        if i < len(dims) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def rotate_to(e: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rotation trick: value q [B, d], gradient to e [B, d] through a fixed rotation + scaling.

    q_tilde = (|q|/|e|) R e with R = I - 2 r r^T + 2 q_hat e_hat^T, r = (e_hat + q_hat)/|...|,
    everything but the last e treated as a constant. R maps e_hat to q_hat, so the value is q,
    and the gradient keeps the angle between e and q instead of copying it unchanged (STE).
    """
    eps = 1e-8
    e_norm = e.norm(dim=-1, keepdim=True).clamp(min=eps)
    q_norm = q.norm(dim=-1, keepdim=True).clamp(min=eps)
    e_hat = (e / e_norm).detach()
    q_hat = (q / q_norm).detach()
    r = F.normalize(e_hat + q_hat, dim=-1, eps=eps).detach()
    lam = (q_norm / e_norm).detach()
    re = e - 2 * (e * r).sum(-1, keepdim=True) * r + 2 * (e * e_hat).sum(-1, keepdim=True) * q_hat
    return lam * re


@dataclass
class RQOutput:
    x_hat: torch.Tensor  # [B, D] reconstruction
    codes: torch.Tensor  # [B, L] long
    residuals: torch.Tensor  # [L, B, code_dim], the input of each level (detached)
    recon_loss: torch.Tensor  # scalar
    quant_loss: torch.Tensor  # scalar, mean over levels of codebook + beta * commitment
    diversity_loss: torch.Tensor  # scalar (0 when the weight is 0)
    loss: torch.Tensor  # scalar, what is minimised


class RQVAE(nn.Module):
    """RQ-VAE over inputs of size cfg.in_dim; see the module docstring.

    Trained with reconstruction MSE + per-level codebook and commitment losses, gradients passed
    through the quantiser by the straight-through estimator or, as an option, the rotation trick
    (`rotate_to`, Fifty et al. 2024). Codebooks are initialised by k-means on real residuals
    (`init_codebooks`); codes left unused are re-seeded from residuals of the current batch
    (`revive_dead_codes`); an optional diversity term pushes the batch's soft code usage towards
    uniform. As in LC-Rec, the last level can pick its training codes by Sinkhorn balanced
    assignment over the batch (`train_sinkhorn_epsilon` > 0; `train_sinkhorn_levels` > 1: as many
    of the last levels, the sid stage's default is every level). `encode` is always the greedy
    nearest code.
    """

    method = "rqvae"

    def __init__(self, cfg: RQVAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dims = [cfg.in_dim, *cfg.encoder_dims, cfg.code_dim]
        self.encoder = mlp(dims, cfg.dropout)
        self.decoder = mlp(dims[::-1], cfg.dropout)
        # [L, K, code_dim]; starts as small noise, `init_codebooks` replaces it with k-means.
        self.codebooks = nn.Parameter(
            torch.randn(cfg.levels, cfg.codebook_size, cfg.code_dim) / math.sqrt(cfg.codebook_size)
        )
        self.register_buffer("initialised", torch.tensor(False))

    # ------------------------------------------------------------------ quantiser interface
    @property
    def levels(self) -> int:
        return self.cfg.levels

    @property
    def codebook_sizes(self) -> list[int]:
        return [self.cfg.codebook_size] * self.cfg.levels

    def level_codebooks(self) -> list[torch.Tensor]:
        """Detached codebook of each level, [K, code_dim] each."""
        return [cb.detach() for cb in self.codebooks]

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy codes LongTensor[N, L] (eval mode, no dropout; encoder in cfg.encode_dtype)."""
        codes, _ = self._greedy(self._enc_eval(x, ENCODE_DTYPES[self.cfg.encode_dtype]))
        return codes

    @torch.no_grad()
    def last_residual(self, x: torch.Tensor) -> torch.Tensor:
        """What the last level quantises, [N, code_dim] (distances to its codebook decide the
        last code; the collision resolver re-scores them)."""
        z = self._enc_eval(x, ENCODE_DTYPES[self.cfg.encode_dtype])
        _, res = self._greedy(z, keep_last_residual=True)
        return res

    @torch.no_grad()
    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Reconstruction [N, D] from codes [N, L]."""
        zq = self.codebooks[torch.arange(self.levels).unsqueeze(0), codes].sum(1)
        was = self.training
        self.eval()
        try:
            return self.decoder(zq)
        finally:
            self.train(was)

    # ------------------------------------------------------------------ internals
    def _enc_eval(self, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Encoder output in eval mode, float32 [N, code_dim], whatever mode the module is in.

        Runs only the Linear layers (dropout is the identity in eval) with ReLU in place: at
        assignment batch sizes each [B, hidden] temporary is megabytes, and allocating it
        once instead of twice per layer is a measurable part of assignment time. With dtype
        bfloat16 the weights are cast per call (cheap next to a batch) and the MLP runs in
        bf16, faster on CPUs with native bf16 (bench/sid/RESULTS.md, "Semantic IDs"); the output
        returns to float32.
        """
        lins = [m for m in self.encoder if isinstance(m, nn.Linear)]
        h = x.to(dtype)
        for i, lin in enumerate(lins):
            h = F.linear(h, lin.weight.to(dtype), lin.bias.to(dtype))
            if i < len(lins) - 1:
                h = h.relu_()
        return h.float()

    def _greedy(self, z: torch.Tensor, keep_last_residual: bool = False):
        cbs = self.codebooks.detach()
        cb_sq = (cbs * cbs).sum(-1)  # [L, K]
        res = z
        codes = torch.empty(z.shape[0], self.levels, dtype=torch.long, device=z.device)
        for lv in range(self.levels):
            if keep_last_residual and lv == self.levels - 1:
                return codes, res
            # argmin |r - e|^2 = argmin |e|^2 - 2 r.e ; |r|^2 is the same for every code.
            idx = row_argmin(torch.addmm(cb_sq[lv].unsqueeze(0), res, cbs[lv].T, alpha=-2.0))
            codes[:, lv] = idx
            res = res - cbs[lv][idx]
        return codes, res

    def forward(self, x: torch.Tensor) -> RQOutput:
        """Training forward on x [B, D]."""
        x = x.float()
        z = self.encoder(x)
        res = z
        zq_total = torch.zeros_like(z)
        codes, residuals, qlosses, dlosses = [], [], [], []
        for lv in range(self.levels):
            cb = self.codebooks[lv]
            d = torch.addmm((cb * cb).sum(-1).unsqueeze(0), res.detach(), cb.detach().T, alpha=-2.0)
            balanced = lv >= self.levels - self.cfg.train_sinkhorn_levels
            if self.training and balanced and self.cfg.train_sinkhorn_epsilon > 0:
                # d lacks |r|^2, a per-row constant that Sinkhorn's row normalisation ignores.
                idx = sinkhorn_assign(d.detach(), self.cfg.train_sinkhorn_epsilon, self.cfg.train_sinkhorn_iters)
            else:
                idx = row_argmin(d)
            q = cb[idx]
            # Codebook term moves codes to residuals; commitment term keeps the encoder near
            # the codes it picked.
            qlosses.append(F.mse_loss(q, res.detach()) + self.cfg.beta * F.mse_loss(res, q.detach()))
            if self.cfg.diversity_weight > 0:
                # Soft usage over the batch, at a temperature set by the typical distance;
                # the term is log K - H(mean usage), 0 when usage is uniform.
                full = d + (res.detach() ** 2).sum(-1, keepdim=True)
                p = torch.softmax(-full / full.detach().mean().clamp(min=1e-8) * 10.0, dim=1)
                pm = p.mean(0)
                dlosses.append(math.log(cb.shape[0]) + (pm * torch.log(pm + 1e-12)).sum())
            q_st = rotate_to(res, q) if self.cfg.rotation_trick else res + (q - res).detach()
            zq_total = zq_total + q_st
            codes.append(idx)
            residuals.append(res.detach())
            res = res - q.detach()
        x_hat = self.decoder(zq_total)
        recon = F.mse_loss(x_hat, x)
        quant = torch.stack(qlosses).mean()
        div = torch.stack(dlosses).mean() if dlosses else torch.zeros((), device=x.device)
        loss = recon + quant + self.cfg.diversity_weight * div
        return RQOutput(
            x_hat=x_hat,
            codes=torch.stack(codes, dim=1),
            residuals=torch.stack(residuals),
            recon_loss=recon,
            quant_loss=quant,
            diversity_loss=div,
            loss=loss,
        )

    # ------------------------------------------------------------------ initialisation / revival
    @torch.no_grad()
    def init_codebooks(
        self, x: torch.Tensor, iters: int = 25, generator: torch.Generator | None = None
    ) -> list[float]:
        """k-means on the real residuals of sample x [N, D], level by level.

        Level 0 clusters the encoder outputs; level l clusters what levels < l leave over.
        Returns the k-means inertia per level. Deterministic for a given generator state.
        """
        z = self._enc_eval(x)
        res = z
        inertias = []
        for lv in range(self.levels):
            km = kmeans(res, self.cfg.codebook_size, iters=iters, generator=generator)
            self.codebooks.data[lv] = km.centroids
            res = res - km.centroids[km.assign]
            inertias.append(km.inertia)
        self.initialised.fill_(True)
        return inertias

    @torch.no_grad()
    def greedy_usage(self, batches) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the final greedy assignment (`encode` in float32) uses: (code counts float64
        [L, K] over every x [B, D] of `batches`, the input of each level for the first batch
        [L, B, code_dim], as `RQOutput.residuals`; None without batches)."""
        cbs = self.codebooks.detach()
        counts = torch.zeros(self.levels, self.cfg.codebook_size, dtype=torch.float64, device=cbs.device)
        first = None
        for x in batches:
            res = self._enc_eval(x.to(cbs.device))
            per_level = []
            for lv in range(self.levels):
                per_level.append(res)
                idx = row_argmin(torch.addmm((cbs[lv] * cbs[lv]).sum(-1).unsqueeze(0), res, cbs[lv].T, alpha=-2.0))
                counts[lv] += torch.bincount(idx, minlength=counts.shape[1]).to(counts.dtype)
                res = res - cbs[lv][idx]
            if first is None:
                first = torch.stack(per_level)
        return counts, first

    @torch.no_grad()
    def revive_dead_codes(
        self,
        counts: torch.Tensor,
        residuals: torch.Tensor,
        threshold: int = 0,
        generator: torch.Generator | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> list[int]:
        """Re-seed codes used <= `threshold` times from residuals of the current batch.

        counts: [L, K] usage over the last window (e.g. one epoch, summed over workers).
        residuals: [L, B, code_dim], the input of each level for the current batch (from
            `RQOutput.residuals`). Each dead code becomes a random residual of its level plus a
            little noise, and its optimiser moments are reset so the old momentum does not
            drag it back. Returns the number of codes revived per level.
        """
        revived = []
        for lv in range(self.levels):
            dead = (counts[lv] <= threshold).nonzero().flatten()
            n_dead = int(dead.numel())
            revived.append(n_dead)
            if n_dead == 0:
                continue
            pool = residuals[lv]
            pick = torch.randint(pool.shape[0], (n_dead,), generator=generator, device="cpu")
            scale = float(pool.std()) if pool.shape[0] > 1 else 1.0
            noise = torch.randn(n_dead, pool.shape[1], generator=generator, device="cpu")
            new = pool[pick.to(pool.device)] + 0.01 * scale * noise.to(pool.device, pool.dtype)
            self.codebooks.data[lv, dead.to(self.codebooks.device)] = new.to(self.codebooks.dtype)
            if optimizer is not None:
                state = optimizer.state.get(self.codebooks, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        state[key][lv, dead.to(state[key].device)] = 0.0
        return revived
