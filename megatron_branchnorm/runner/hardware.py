"""What this machine's CPU can do for training: the instruction-set flags that decide whether
bf16 (and fp16) run natively, read from ``/proc/cpuinfo``.

Development machines differ (docs/performance.md): some have
AVX-512-BF16 or AMX, where a bf16 training step ran 1.7x faster than fp32; others have AVX2
only, where a single bf16 2048^3 matmul takes minutes. Benchmarks print these flags and run
their bf16 sections only where bf16 is native.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)
"""The flags that decide matmul speed per precision (Linux names)."""


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: tuple[str, ...]
    """The :data:`RELEVANT_FLAGS` this CPU has, in that order."""

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX-512-BF16 or AMX-BF16)."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def native_fp16(self) -> bool:
        """fp16 arithmetic in hardware (AVX-512-FP16 or AMX-FP16)."""
        return "avx512_fp16" in self.flags or "amx_fp16" in self.flags

    def describe(self) -> str:
        """One line: model, flags, what runs natively."""
        native = [p for p, ok in (("bf16", self.native_bf16), ("fp16", self.native_fp16)) if ok]
        return (
            f"CPU: {self.model}; flags: {' '.join(self.flags) or 'none of ' + ','.join(RELEVANT_FLAGS)}; "
            f"native: fp32{''.join(', ' + p for p in native)}"
        )


def parse_cpuinfo(text: str) -> CpuInfo:
    """:class:`CpuInfo` from the text of ``/proc/cpuinfo`` (the first processor's lines)."""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return CpuInfo(model, tuple(f for f in RELEVANT_FLAGS if f in flags))


def cpu_info(path: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """This machine's :class:`CpuInfo` (model "unknown" and no flags where the file is not
    readable, e.g. not Linux)."""
    try:
        return parse_cpuinfo(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return CpuInfo("unknown", ())


def default_dtypes(info: CpuInfo) -> tuple[str, ...]:
    """The precisions a CPU benchmark runs by default: bf16 only where it is native."""
    return ("fp32", "bf16") if info.native_bf16 else ("fp32",)
