"""Building, saving and loading a SID quantiser (RQ-VAE or residual k-means) by config.

What it is for: one place that turns `sid` config + input size into a quantiser, and writes /
reads it as `quantizer.safetensors` (weights) + `quantizer.json` (method and constructor
arguments), so later stages and `recommend` can re-encode new items without the training code.
Both quantisers expose: `levels`, `codebook_sizes`, `encode(x [N, D]) -> LongTensor[N, L]`,
`last_residual(x) -> [N, d]`, `decode_codes(codes) -> [N, D]`, `level_codebooks() -> [K, d] x L`.

What it does not know: training, collision handling, Ray. Weights load only from safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gti.common.errors import DataError
from gti.sid.rqkmeans import RQKMeansConfig, ResidualKMeans
from gti.sid.rqvae import RQVAE, RQVAEConfig

WEIGHTS_NAME = "quantizer.safetensors"
CONFIG_NAME = "quantizer.json"


def build_quantizer(sid_cfg, in_dim: int):
    """A fresh quantiser for `sid_cfg.method` (untrained)."""
    if sid_cfg.method == "rqvae":
        return RQVAE(RQVAEConfig.from_sid_config(sid_cfg, in_dim))
    return ResidualKMeans(RQKMeansConfig.from_sid_config(sid_cfg, in_dim))


def save_quantizer(q, folder: str | Path) -> tuple[Path, Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in q.state_dict().items()}
    wpath, cpath = folder / WEIGHTS_NAME, folder / CONFIG_NAME
    save_file(state, str(wpath))
    cpath.write_text(json.dumps({"method": q.method, "config": q.cfg.to_dict()}, indent=1))
    return wpath, cpath


def load_quantizer(folder: str | Path, map_location: str = "cpu"):
    """Quantiser saved by `save_quantizer` (eval mode)."""
    folder = Path(folder)
    cpath, wpath = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not cpath.is_file() or not wpath.is_file():
        raise DataError(f"no quantizer in {folder} (need {CONFIG_NAME} and {WEIGHTS_NAME})")
    meta = json.loads(cpath.read_text())
    if meta.get("method") == "rqvae":
        q = RQVAE(RQVAEConfig(**meta["config"]))
    elif meta.get("method") == "rqkmeans":
        q = ResidualKMeans(RQKMeansConfig(**meta["config"]))
    else:
        raise DataError(f"{cpath}: unknown quantizer method {meta.get('method')!r}")
    q.load_state_dict(load_file(str(wpath), device=map_location))
    return q.eval()


def codebooks_tensor(q) -> dict[str, torch.Tensor]:
    """{'level_l': float32 [K, d]} as written to codebooks.safetensors."""
    return {f"level_{i}": cb.detach().float().cpu().contiguous() for i, cb in enumerate(q.level_codebooks())}
