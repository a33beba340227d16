"""Energy and cost of serving: joules from the machine's own counters where it has them, a
stated estimate where it does not, and dollars from a price per hour.

Sources, best first; every figure carries its label (``measured`` or ``estimated``) and how
it was made:

- **RAPL** (``/sys/class/powercap/intel-rapl:N/energy_uj``, Intel and AMD on bare-metal
  Linux): each CPU package's cumulative microjoules; the counter wraps at
  ``max_energy_range_uj``, so a reading must come at least once per wrap (minutes at full
  power: the server's collector and the bench read far more often). Measured, machine-wide:
  other processes on the machine count too.
- **NVML** (``nvidia-ml-py``, ``nvmlDeviceGetTotalEnergyConsumption``, millijoules since the
  driver loaded), for each visible GPU. Measured.
- **An estimate** where neither is readable (VMs, containers, laptops without permission):
  the CPU seconds of this process and its descendants (the engine core, ranks) times a power
  per busy logical CPU, ``--watts-per-cpu`` or DEFAULT_WATTS_PER_CPU. Labelled ``estimated``.

A GPU measured beside an estimated CPU makes the whole ``estimated``: a sum is only as
measured as its least measured part.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

POWERCAP = Path("/sys/class/powercap")
# Package power at full load over hardware threads, on the server CPUs these machines rent:
# AMD EPYC 7763 280 W / 128 = 2.2 W, Intel Xeon 8380 270 W / 80 = 3.4 W, EPYC 9654 360 W / 192
# = 1.9 W; 3 W per busy logical CPU covers the package and a share of memory's. An estimate.
DEFAULT_WATTS_PER_CPU = 3.0
MEASURED, ESTIMATED = "measured", "estimated"


@dataclass(frozen=True)
class EnergyReading:
    """Joules since the meter started, and what they are worth."""

    joules: float
    seconds: float
    source: str  # MEASURED or ESTIMATED
    how: str  # e.g. "RAPL package-0 + package-1", "3.0 W per busy CPU x 41.2 CPU-s"

    @property
    def watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0


class RaplCounter:
    """The CPU packages' RAPL counters under ``root`` (top-level domains ``intel-rapl:N`` only:
    their subdomains, core and uncore, are parts of the package's figure)."""

    def __init__(self, root: Path = POWERCAP) -> None:
        self.domains: list[tuple[Path, int, str]] = []  # energy_uj file, wrap range, name
        for d in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
            if d.name.count(":") != 1:
                continue
            try:
                int((d / "energy_uj").read_text())
                wrap = int((d / "max_energy_range_uj").read_text())
                name = (d / "name").read_text().strip() if (d / "name").exists() else d.name
            except (OSError, ValueError):
                continue  # not readable (root only since 2020's PLATYPUS fix): not a source
            self.domains.append((d / "energy_uj", wrap, name))
        self._last = [self._raw(f) for f, _, _ in self.domains]
        self._total_uj = 0

    @staticmethod
    def _raw(f: Path) -> int:
        return int(f.read_text())

    def __bool__(self) -> bool:
        return bool(self.domains)

    def joules(self) -> float:
        """Joules since this counter was made; each domain's wrap undone."""
        for i, (f, wrap, _) in enumerate(self.domains):
            now = self._raw(f)
            delta = now - self._last[i]
            self._total_uj += delta if delta >= 0 else delta + wrap + 1
            self._last[i] = now
        return self._total_uj / 1e6

    def describe(self) -> str:
        return "RAPL " + " + ".join(name for _, _, name in self.domains)


class NvmlCounter:
    """Every visible GPU's energy counter, through NVML (absent: no package, no driver, no GPU)."""

    def __init__(self) -> None:
        self.handles: list = []
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self._read = pynvml.nvmlDeviceGetTotalEnergyConsumption
            self._start = [self._read(h) for h in handles]  # raises where the GPU has no counter
            self.handles = handles
        except Exception:
            self.handles = []

    def __bool__(self) -> bool:
        return bool(self.handles)

    def joules(self) -> float:
        return sum(self._read(h) - s for h, s in zip(self.handles, self._start, strict=True)) / 1e3

    def describe(self) -> str:
        return f"NVML {len(self.handles)} GPU" + ("s" if len(self.handles) > 1 else "")


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


def process_tree_cpu_seconds(pid: int | None = None, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) of process ``pid`` (this one) and its living descendants,
    from /proc; where there is no /proc, this process's and its waited-for children's."""
    pid = os.getpid() if pid is None else pid
    if not (proc / str(pid) / "stat").exists():
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    parents: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        p = int(entry.name)
        parents.setdefault(int(fields[1]), []).append(p)  # ppid
        ticks[p] = int(fields[11]) + int(fields[12])  # utime + stime
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo += parents.get(p, [])
    return total / _ticks_per_second()


def machine_cpu_seconds(stat: Path = Path("/proc/stat")) -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat's first line: every field
    but idle and iowait), for a meter outside the server it measures (bench serve against a
    server that exports no energy)."""
    fields = [int(x) for x in stat.read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / _ticks_per_second()


class CpuTimeEstimate:
    """Joules estimated as a power per busy logical CPU times the CPU seconds a process tree
    spent (this process and what it started, unless ``cpu_seconds`` says otherwise)."""

    def __init__(self, watts_per_cpu: float, cpu_seconds: Callable[[], float] = process_tree_cpu_seconds) -> None:
        if not watts_per_cpu > 0:
            raise ValueError(f"watts per CPU must be positive, got {watts_per_cpu}")
        self.watts_per_cpu = watts_per_cpu
        self._cpu_seconds = cpu_seconds
        self._start = cpu_seconds()
        self.busy = 0.0

    def joules(self) -> float:
        self.busy = self._cpu_seconds() - self._start
        return self.watts_per_cpu * self.busy

    def describe(self) -> str:
        return f"{self.watts_per_cpu:g} W per busy CPU x {self.busy:.1f} CPU-s"


class EnergyMeter:
    """Joules since it was made, from the best sources this machine has (see the module doc):
    RAPL for the CPU or the estimate, plus NVML for GPUs. ``watts_per_cpu`` set forces the
    estimate for the CPU (a user who knows better than a default, or than a shared machine's
    RAPL)."""

    def __init__(
        self,
        watts_per_cpu: float | None = None,
        powercap: Path = POWERCAP,
        gpus: bool = True,
        cpu_seconds: Callable[[], float] = process_tree_cpu_seconds,
    ) -> None:
        rapl = RaplCounter(powercap) if watts_per_cpu is None else None
        self.cpu: RaplCounter | CpuTimeEstimate = (
            rapl if rapl else CpuTimeEstimate(watts_per_cpu or DEFAULT_WATTS_PER_CPU, cpu_seconds)
        )
        self.gpu = NvmlCounter() if gpus else None
        self.t0 = time.monotonic()

    @property
    def source(self) -> str:
        return MEASURED if isinstance(self.cpu, RaplCounter) else ESTIMATED

    def read(self) -> EnergyReading:
        joules = self.cpu.joules()
        how = self.cpu.describe()
        if self.gpu:
            joules += self.gpu.joules()
            how += " + " + self.gpu.describe()
        return EnergyReading(joules, time.monotonic() - self.t0, self.source, how)


def dollars_per_million(price_per_hour: float, seconds: float, tokens: int) -> float | None:
    """What ``tokens`` cost per million when the machine costs ``price_per_hour`` and they
    took ``seconds`` of it (the rate at the load measured: idle time is paid for too)."""
    if tokens <= 0 or seconds <= 0:
        return None
    return price_per_hour * seconds / 3600 / tokens * 1e6


def joules_per_token(joules: float, tokens: int) -> float | None:
    return joules / tokens if tokens > 0 else None
