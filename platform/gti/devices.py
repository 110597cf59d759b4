"""What the hardware here can do, for choices that depend on it (precision).

What it is for: `native_bf16(device)` says whether bf16 matrix products run natively (CUDA with
bf16 support, or a CPU with AVX512-BF16 / AMX, through oneDNN); `resolve_precision(setting,
use_gpu)` turns a training config's `precision` ("auto" | "fp32" | "bf16") into the one the run
uses: "auto" is bf16 where it is native and fp32 elsewhere, where emulated bf16 would be slower
than fp32.

What it does not know: configs, models, Ray. Pure torch queries, no side effects.
"""

from __future__ import annotations

import torch

PRECISIONS = ("auto", "fp32", "bf16")


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 matrix products run natively here (CUDA, or a CPU with AVX512-BF16/AMX);
    elsewhere they are emulated and slower than float32."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(setting: str, use_gpu: bool = False) -> str:
    """`ground.precision` / `sft.precision` -> "bf16" | "fp32".

    "auto": bf16 autocast where bf16 is native on the device the workers train on (CUDA when
    `use_gpu`, else this CPU), fp32 elsewhere. Explicit values pass through unchanged.
    Master weights and optimizer state are fp32 either way (autocast only changes the dtype of
    the forward's matrix products).
    """
    if setting not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {setting!r}")
    if setting != "auto":
        return setting
    return "bf16" if native_bf16("cuda" if use_gpu else "cpu") else "fp32"
