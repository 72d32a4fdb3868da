"""/proc/cpuinfo read once for the whole engine (engine/cpu_features.py)."""
from __future__ import annotations

from nightshift.engine import cpu_features


def test_cpuinfo_fields_are_the_first_processor_s(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R45\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n")
    assert cpu_features._cpuinfo("vendor_id", str(info)) == "AuthenticAMD"
    assert cpu_features._cpuinfo("flags", str(info)).split() == ["fpu", "avx2", "avx512f", "avx512_bf16"]
    assert cpu_features._cpuinfo("model name", str(info)) == "AMD EPYC 9R45"
    assert cpu_features._cpuinfo("microcode", str(info)) == ""
    assert cpu_features._cpuinfo("vendor_id", str(tmp_path / "absent")) == ""


def test_cpu_family_is_the_cpuinfo_number_or_zero(monkeypatch):
    for text, family in (("26", 26), ("6", 6), ("", 0), ("unknown", 0)):
        monkeypatch.setattr(cpu_features, "_cpuinfo", lambda field, text=text: text if field == "cpu family" else "")
        assert cpu_features.cpu_family.__wrapped__() == family
