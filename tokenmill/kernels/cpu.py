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
    model: str  # the model name, and its family/model/stepping where the name alone is a VM's generic one
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


def read_cpuinfo(lines) -> tuple[str | None, set[str]]:
    """The first processor's model and flags from /proc/cpuinfo's lines (None: no model name).

    A cloud VM often names only the vendor's line ("AMD EPYC" for a Zen 1 and a Zen 3 alike),
    so the family, model and stepping numbers are kept with the name: they tell apart the
    machines whose speeds differ (a benchmark's record, the GEMM probe's kept answers) and
    whose ``-march=native`` code differs (the native build's name)."""
    model, flags, ids = None, set(), {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key in ("cpu family", "model", "stepping"):
            ids[key] = value.strip()
        elif key in ("flags", "Features"):
            flags = set(value.split())
            break
    if model is not None and len(ids) == 3:
        model += f" (family {ids['cpu family']} model {ids['model']} stepping {ids['stepping']})"
    return model, flags


@cache
def cpu_info() -> CpuInfo:
    """The machine's CPU (from /proc/cpuinfo where there is one)."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            model, flags = read_cpuinfo(f)
    except OSError:
        pass
    return CpuInfo(
        model=model or platform.processor() or platform.machine(),
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=tuple(f for f in INTERESTING_FLAGS if f in flags),
        cores=os.cpu_count() or 1,
        torch=torch.__version__,
    )
