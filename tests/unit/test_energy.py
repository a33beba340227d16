"""The energy meter's arithmetic on counter files laid out as the kernel lays them out (RAPL
under /sys/class/powercap, /proc's stat files), and the price per million tokens."""

from __future__ import annotations

import os
import sys

import pytest

from tokenmill.host.energy import (
    ESTIMATED,
    MEASURED,
    CpuTimeEstimate,
    EnergyMeter,
    RaplCounter,
    dollars_per_million,
    machine_cpu_seconds,
    process_tree_cpu_seconds,
)

pytestmark = pytest.mark.unit


def rapl_domain(root, name: str, label: str, uj: int, wrap: int = 262143328850) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{wrap}\n")
    (d / "name").write_text(f"{label}\n")


def set_uj(root, name: str, uj: int) -> None:
    (root / name / "energy_uj").write_text(f"{uj}\n")


def test_rapl_sums_the_packages_not_their_subdomains(tmp_path):
    rapl_domain(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    rapl_domain(tmp_path, "intel-rapl:1", "package-1", 5_000_000)
    rapl_domain(tmp_path, "intel-rapl:0:0", "core", 400_000)  # part of package-0's figure
    meter = EnergyMeter(powercap=tmp_path, gpus=False)
    assert meter.source == MEASURED
    set_uj(tmp_path, "intel-rapl:0", 3_500_000)  # +2.5 J
    set_uj(tmp_path, "intel-rapl:1", 6_000_000)  # +1.0 J
    set_uj(tmp_path, "intel-rapl:0:0", 9_400_000)  # ignored
    reading = meter.read()
    assert reading.joules == pytest.approx(3.5)
    assert reading.source == MEASURED and reading.how == "RAPL package-0 + package-1"


def test_rapl_wraparound_is_undone(tmp_path):
    rapl_domain(tmp_path, "intel-rapl:0", "package-0", 999_000_000, wrap=999_999_999)
    counter = RaplCounter(tmp_path)
    set_uj(tmp_path, "intel-rapl:0", 500_000)  # wrapped: 999_999 uJ to the top, +1 to 0, +500_000
    assert counter.joules() == pytest.approx((999_999_999 - 999_000_000 + 1 + 500_000) / 1e6)
    set_uj(tmp_path, "intel-rapl:0", 2_500_000)
    assert counter.joules() == pytest.approx((999_999_999 - 999_000_000 + 1 + 2_500_000) / 1e6)


def test_unreadable_rapl_falls_back_to_the_labelled_estimate(tmp_path):
    d = tmp_path / "intel-rapl:0"
    d.mkdir()
    (d / "max_energy_range_uj").write_text("100\n")  # no energy_uj: as an unprivileged user sees none
    busy = iter([10.0, 10.0, 24.0])
    meter = EnergyMeter(powercap=tmp_path, gpus=False, cpu_seconds=lambda: next(busy))
    assert meter.source == ESTIMATED
    reading = meter.read()  # 0 CPU-s yet
    assert reading.joules == 0.0
    reading = meter.read()  # 14 CPU-s at the default 3 W
    assert reading.joules == pytest.approx(42.0) and reading.source == ESTIMATED
    assert reading.how == "3 W per busy CPU x 14.0 CPU-s"


def test_watts_per_cpu_given_forces_the_estimate_even_with_rapl(tmp_path):
    rapl_domain(tmp_path, "intel-rapl:0", "package-0", 0)
    busy = iter([0.0, 2.0])
    meter = EnergyMeter(watts_per_cpu=7.5, powercap=tmp_path, gpus=False, cpu_seconds=lambda: next(busy))
    assert meter.source == ESTIMATED and meter.read().joules == pytest.approx(15.0)
    with pytest.raises(ValueError, match="positive"):
        CpuTimeEstimate(0.0)


def test_process_tree_cpu_seconds_sums_descendants_only(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")

    def proc(pid: int, ppid: int, utime: int, stime: int, comm: str = "python") -> None:
        (tmp_path / str(pid)).mkdir()
        rest = ["S", str(ppid)] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 30
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")

    proc(100, 1, 3 * ticks, 1 * ticks)  # the server: 4 s
    proc(101, 100, 10 * ticks, 2 * ticks, comm="engine core (x) y")  # its core: 12 s, a comm with ") "
    proc(102, 101, ticks, 0)  # a rank the core started: 1 s
    proc(200, 1, 50 * ticks, 0)  # a stranger
    (tmp_path / "self").mkdir()  # not a pid
    assert process_tree_cpu_seconds(100, proc=tmp_path) == pytest.approx(17.0)
    assert process_tree_cpu_seconds(101, proc=tmp_path) == pytest.approx(13.0)


def test_machine_cpu_seconds_counts_busy_fields(tmp_path):
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    f = [v * ticks for v in (5, 1, 2, 100, 7, 1, 1, 3, 0, 0)]
    stat.write_text("cpu  " + " ".join(map(str, f)) + "\ncpu0 1 2 3\n")
    assert machine_cpu_seconds(stat) == pytest.approx(5 + 1 + 2 + 1 + 1 + 3)


def test_dollars_per_million_tokens():
    # the lecture's worked example: $64 an hour at 3,000 tokens a second
    assert dollars_per_million(64.0, 3600.0, 3000 * 3600) == pytest.approx(5.93, abs=0.005)
    assert dollars_per_million(2.0, 10.0, 0) is None


class FakeNvml:
    """pynvml's surface that the meter reads (nvmlInit, device handles, millijoules since the
    driver loaded), over counters the test moves; ``unsupported``: a GPU without a counter
    (pre-Volta), where NVML raises."""

    def __init__(self, millijoules: list[int], unsupported: bool = False) -> None:
        self.mj, self.unsupported = millijoules, unsupported

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.mj)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        if self.unsupported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.mj[handle]


def test_nvml_adds_every_gpus_millijoules_to_the_cpus_joules(tmp_path, monkeypatch):
    nvml = FakeNvml([1_000_000, 250_000])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    rapl_domain(tmp_path, "intel-rapl:0", "package-0", 0)
    meter = EnergyMeter(powercap=tmp_path, gpus=True)
    nvml.mj[0] += 120_500  # +120.5 J
    nvml.mj[1] += 30_000  # +30 J
    set_uj(tmp_path, "intel-rapl:0", 2_000_000)  # +2 J
    reading = meter.read()
    assert reading.joules == pytest.approx(152.5)
    assert reading.source == MEASURED and reading.how == "RAPL package-0 + NVML 2 GPUs"
    assert EnergyMeter(powercap=tmp_path, gpus=False).read().how == "RAPL package-0"


def test_a_gpu_without_an_energy_counter_is_left_out_not_guessed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([5_000], unsupported=True))
    busy = iter([0.0, 4.0])
    meter = EnergyMeter(powercap=tmp_path, gpus=True, cpu_seconds=lambda: next(busy))
    reading = meter.read()
    assert not meter.gpu and reading.joules == pytest.approx(12.0) and "NVML" not in reading.how
