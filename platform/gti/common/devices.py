"""What the hardware here can do, for choices that depend on it (precision, threads).

What it is for: `native_bf16(device)` says whether bf16 matrix products run natively;
`resolve_precision(setting, use_gpu)` turns a training config's `precision` ("auto" | "fp32" |
"bf16") into the one the run uses ("auto": bf16 where it is native, fp32 elsewhere, where
emulated bf16 would be slower); `cpu_threads` / `use_cpu_threads` set torch's intra-op threads
in a worker when the config asks; `cpu_facts()` names this machine's CPU and the instruction
sets that pick float kernels, for manifests (the same data and config can round differently on
another ISA).

What it does not know: configs, models, Ray. Pure torch queries; only `use_cpu_threads`
changes anything (torch's thread count in this process).
"""

from __future__ import annotations

import os
import platform

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


def cpu_threads(setting: int | None) -> int | None:
    """torch intra-op threads for one CPU worker: `setting`, or None to keep what Ray set.

    Ray sets OMP_NUM_THREADS to the CPUs a worker or actor reserves (1 by default), so a single
    Train worker on a 2-core laptop trains on one core unless the config asks for more (a
    SmolLM2 SFT step is faster on two threads: bench/train_throughput/RESULTS.md, "Training step
    throughput"). More threads than the worker reserved only pay when it has the node to
    itself: several workers, Tune trials or compare arms on one machine would oversubscribe
    the cores, hence no automatic default."""
    return None if setting is None else max(1, int(setting))


def use_cpu_threads(setting: int | None) -> int:
    """Apply `cpu_threads(setting)` to torch in this process; returns the thread count in use."""
    n = cpu_threads(setting)
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# /proc/cpuinfo flags that choose which float kernels MKL, oneDNN and faiss run.
_ISA_PREFIXES = ("sse4", "avx", "amx", "fma", "f16c", "neon", "asimd", "sve")


def cpu_facts(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """{"cpu_model": str, "isa_flags": sorted SIMD flags, "cpu_count": int} of this machine;
    model and flags from `cpuinfo` (empty where it is not readable, e.g. not Linux)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and val.strip():
                    model = val.strip()
                elif key in ("flags", "Features"):
                    flags.update(w for w in val.split() if w.startswith(_ISA_PREFIXES))
                elif not line.strip() and flags:
                    break  # the first processor's block is enough
    except OSError:
        pass
    return {"cpu_model": model, "isa_flags": sorted(flags), "cpu_count": os.cpu_count() or 0}
