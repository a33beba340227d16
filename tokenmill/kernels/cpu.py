"""What the CPU can do, read once: the ISA level torch dispatches to, and the flags that
decide our choices (bfloat16 by default where the CPU multiplies it natively; which
native build to load). Every benchmark result and ``tokenmill plan`` records it."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from functools import cache

import torch

# The flags that matter to an inference engine on x86: vector width, bfloat16 and int8
# dot products (AVX512_BF16, VNNI) and the AMX tile units.
INTERESTING_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class CpuInfo:
    model: str
    capability: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512 ...
    flags: tuple[str, ...]
    cores: int
    torch: str

    @property
    def native_bf16(self) -> bool:
        """True where bfloat16 matmuls run on dedicated instructions (AVX512_BF16 or AMX)."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def isa_tag(self) -> str:
        """A short name for the instruction set a native build targets."""
        for flag, tag in (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
            if flag in self.flags:
                return tag
        return platform.machine().lower() or "generic"

    def as_dict(self) -> dict:
        return asdict(self) | {"native_bf16": self.native_bf16}

    def describe(self) -> str:
        return f"{self.model}, {self.cores} cores, torch {self.capability}, flags {' '.join(self.flags) or 'none'}"


@cache
def cpu_info() -> CpuInfo:
    """The machine's CPU (from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return CpuInfo(
        model=model,
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=tuple(f for f in INTERESTING_FLAGS if f in flags),
        cores=os.cpu_count() or 1,
        torch=torch.__version__,
    )
