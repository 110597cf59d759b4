"""gti.common.devices: `precision: auto` resolves to bf16 exactly where bf16 is native."""

from __future__ import annotations

import pytest

from gti.common import devices


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_native_bf16_on_cpu(monkeypatch, native):
    monkeypatch.setattr(devices, "native_bf16", lambda device="cpu": native and device == "cpu")
    assert devices.resolve_precision("auto", use_gpu=False) == ("bf16" if native else "fp32")


def test_auto_asks_about_cuda_when_training_on_gpu(monkeypatch):
    asked = []
    monkeypatch.setattr(devices, "native_bf16", lambda device="cpu": asked.append(device) or device == "cuda")
    assert devices.resolve_precision("auto", use_gpu=True) == "bf16"
    assert asked == ["cuda"]


@pytest.mark.parametrize("explicit", ["fp32", "bf16"])
def test_explicit_values_pass_through(monkeypatch, explicit):
    monkeypatch.setattr(devices, "native_bf16", lambda device="cpu": pytest.fail("must not probe"))
    assert devices.resolve_precision(explicit) == explicit


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match="fp16"):
        devices.resolve_precision("fp16")


def test_native_bf16_where_the_cpu_has_bf16_instructions():
    """A CPU whose flags list AVX512-BF16 or AMX-BF16 is reported native (oneDNN may also say
    yes on some AVX512 CPUs without them, so only this direction is checked)."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo on this OS")
    flags = set(info.read_text().split())
    if not {"avx512_bf16", "amx_bf16"} & flags:
        pytest.skip("this CPU has no bf16 instructions")
    assert devices.native_bf16("cpu") is True


def test_config_default_is_auto():
    from gti.config.train import GroundConfig, SftConfig

    assert GroundConfig().precision == "auto" and SftConfig().precision == "auto"


def test_cpu_threads_only_when_asked():
    assert devices.cpu_threads(None) is None  # keep what Ray set for the worker
    assert devices.cpu_threads(3) == 3


def test_use_cpu_threads_sets_torch_or_leaves_it():
    import torch

    before = torch.get_num_threads()
    try:
        assert devices.use_cpu_threads(None) == before and torch.get_num_threads() == before
        assert devices.use_cpu_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_cpu_facts_reads_model_and_simd_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse4_2 avx2 avx512_bf16 ht\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: amx_tile\n")
    f = devices.cpu_facts(str(info))
    assert f["cpu_model"] == "Test CPU 9000"
    assert f["isa_flags"] == ["avx2", "avx512_bf16", "sse4_2"]  # first CPU only, SIMD flags only
    assert f["cpu_count"] >= 1
    assert devices.cpu_facts(str(tmp_path / "missing"))["isa_flags"] == []
