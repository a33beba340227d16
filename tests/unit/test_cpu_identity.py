"""The CPU's identity: two machines a VM names alike ("AMD EPYC") are told apart, so a
benchmark's record, the GEMM probe's kept answers and a ``-march=native`` build are each
the machine's own."""

from tokenmill.kernels import cpu, native
from tokenmill.kernels.cpu import CpuInfo, read_cpuinfo

ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 2
flags\t\t: fpu sse avx avx2 fma
processor\t: 1
model name\t: something else
"""
ZEN3 = ZEN1.replace("cpu family\t: 23", "cpu family\t: 25").replace("stepping\t: 2", "stepping\t: 1")


def test_generic_model_names_keep_family_model_and_stepping():
    assert read_cpuinfo(ZEN1.splitlines()) == (
        "AMD EPYC (family 23 model 1 stepping 2)",
        {"fpu", "sse", "avx", "avx2", "fma"},
    )
    assert read_cpuinfo(ZEN3.splitlines())[0] == "AMD EPYC (family 25 model 1 stepping 1)"
    assert read_cpuinfo(["Features\t: fp asimd\n"]) == (None, {"fp", "asimd"})  # an ARM board: no model name


def test_native_builds_of_two_cpus_with_the_same_isa_have_different_names(monkeypatch):
    sources = {"a.cpp": b"int f();"}
    names = {}
    for label, text in (("zen1", ZEN1), ("zen3", ZEN3)):
        model, flags = read_cpuinfo(text.splitlines())
        info = CpuInfo(model=model, capability="AVX2", flags=("avx2", "fma"), cores=2, torch="2.13.0")
        monkeypatch.setattr(native, "cpu_info", lambda info=info: info)
        monkeypatch.setenv("TOKENMILL_MARCH", "native")
        names[label] = native.build_name(sources)
        monkeypatch.setenv("TOKENMILL_MARCH", "haswell")  # a named -march is the same code on both
        names[label + " haswell"] = native.build_name(sources)
    assert names["zen1"] != names["zen3"]
    assert names["zen1"].startswith("tokenmill_cpu_avx2_")
    assert names["zen1 haswell"] == names["zen3 haswell"]
    assert cpu.cpu_info().model  # this machine's reads
