"""`bench/machine.py`: the CPU variant a bench's JSON names."""

from __future__ import annotations

import json

from bench.machine import cpu_variant

INTEL_VM = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: SomethingElse
cpu family\t: 99
"""

AMD_VM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC Processor
flags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni avx512_vp2intersect
"""


def test_an_intel_vm_is_named_by_family_and_model_from_the_first_processor() -> None:
    cpu = cpu_variant(INTEL_VM)
    assert (cpu["vendor"], cpu["family"], cpu["model"]) == ("GenuineIntel", 6, 207)
    assert cpu["model_name"] == "Intel(R) Xeon(R) Processor"
    assert cpu["isa"] == ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16",
                          "amx_int8"]  # fmt: skip


def test_an_amd_vm_has_no_amx_and_its_own_family() -> None:
    cpu = cpu_variant(AMD_VM)
    assert (cpu["vendor"], cpu["family"], cpu["model"]) == ("AuthenticAMD", 26, 2)
    assert "amx_bf16" not in cpu["isa"] and "avx512_bf16" in cpu["isa"]


def test_without_cpuinfo_it_still_names_something_and_is_json() -> None:
    cpu = cpu_variant("")
    assert cpu["family"] is None and cpu["model"] is None and cpu["isa"] == []
    assert cpu["model_name"] and cpu["vendor"]
    assert json.loads(json.dumps(cpu)) == cpu


def test_malformed_lines_and_numbers_are_left_out_not_raised() -> None:
    cpu = cpu_variant("no colon here\nvendor_id : GenuineIntel\ncpu family : six\nmodel :\n::\n")
    assert (cpu["vendor"], cpu["family"], cpu["model"]) == ("GenuineIntel", None, None)


def test_this_machine_reads() -> None:
    cpu = cpu_variant()
    assert cpu["logical_cpus"] >= 1 and isinstance(cpu["isa"], list)
