"""CPU flags decide which precisions a CPU benchmark runs (megatron_branchnorm/runner/hardware.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_branchnorm.runner.hardware import cpu_info, default_dtypes, parse_cpuinfo

ZEN1 = "processor\t: 0\nmodel name\t: AMD EPYC 7551\nflags\t\t: fpu sse2 avx avx2 fma\n"
SAPPHIRE = (
    "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "flags\t\t: avx2 fma avx512f avx512_bf16 avx512_fp16 amx_tile amx_bf16\n"
    "processor\t: 1\nmodel name\t: other\nflags\t\t: avx2\n"
)


def test_avx2_only_runs_fp32():
    info = parse_cpuinfo(ZEN1)
    assert info.model == "AMD EPYC 7551"
    assert info.flags == ("avx2", "fma")
    assert not info.native_bf16 and not info.native_fp16
    assert default_dtypes(info) == ("fp32",)
    assert info.describe().endswith("native: fp32")


def test_avx512_bf16_or_amx_runs_bf16_too():
    info = parse_cpuinfo(SAPPHIRE)  # the first processor's lines count
    assert info.model.startswith("Intel(R) Xeon(R) Platinum")
    assert info.native_bf16 and info.native_fp16
    assert default_dtypes(info) == ("fp32", "bf16")
    assert "amx_bf16" in info.describe() and "native: fp32, bf16, fp16" in info.describe()


def test_unreadable_cpuinfo_is_no_flags(tmp_path):
    info = cpu_info(tmp_path / "missing")
    assert info.flags == () and default_dtypes(info) == ("fp32",)


def test_benchmark_help_names_the_default():
    tool = Path(__file__).resolve().parents[2] / "tools" / "benchmark.py"
    out = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bf16 only where the CPU has AVX-512-BF16 or AMX" in " ".join(out.stdout.split())
