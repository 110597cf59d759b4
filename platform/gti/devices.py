"""What the hardware here can do, for choices that depend on it (precision).

What it is for: `native_bf16(device)` says whether bf16 matrix products run natively (CUDA with
bf16 support, or a CPU with AVX512-BF16 / AMX, through oneDNN); `resolve_precision(setting,
use_gpu)` turns a training config's `precision` ("auto" | "fp32" | "bf16") into the one the run
uses: "auto" is bf16 where it is native and fp32 elsewhere, where emulated bf16 would be slower
than fp32.

`cpu_threads` / `use_cpu_threads` size torch's intra-op threads for a process sharing a
node with others (Ray leaves its workers one thread otherwise).

What it does not know: configs, models, Ray. Pure torch queries; only `use_cpu_threads`
changes anything (torch's thread count in this process).
"""

from __future__ import annotations

import os

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


def cpu_threads(setting: int | None, processes_on_node: int) -> int:
    """torch intra-op threads for one CPU process that shares this node with
    `processes_on_node - 1` others: `setting` when given, else the node's cores split evenly.

    Why: Ray sets OMP_NUM_THREADS=1 in its workers and actors unless they reserve more CPUs,
    so a single Train worker on a 2-core laptop trained on one core (SmolLM2 SFT step 3.9 s
    instead of 3.2 s; bench/RESULTS.md)."""
    if setting is not None:
        return max(1, int(setting))
    return max(1, (os.cpu_count() or 1) // max(1, int(processes_on_node)))


def use_cpu_threads(setting: int | None, processes_on_node: int) -> int:
    """Apply `cpu_threads(...)` to torch in this process; returns the number set."""
    n = cpu_threads(setting, processes_on_node)
    torch.set_num_threads(n)
    return n
