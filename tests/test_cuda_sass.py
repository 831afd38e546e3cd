"""benchmarks/cuda_sass.py's reading of cuobjdump listings (the docs quote its register and loop counts and
its same-instructions comparisons). Pure python over a synthetic listing; compiling needs NVRTC."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_sass.py"
_spec = importlib.util.spec_from_file_location("cuda_sass_script", _path)
cuda_sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_sass)

LISTING = """
        Function : _Z17nvfp4_decode_gemmILi8ELi2ELi1ELi0ELi0ELi0ELi0EEvPK2U4
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0030*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;
        /*0040*/                   IADD3 R2, P0, R2, 0x200, RZ ;
        /*0050*/              @P0  BRA 0x20 ;
        /*0060*/                   STG.E.U16 desc[UR4][R10.64], R9 ;
        /*0070*/                   EXIT ;
"""


def test_instructions_leave_out_addresses_and_the_name():
    ins = cuda_sass.instructions(LISTING)
    assert ins[0] == "LDC R1, c[0x0][0x28]" and ins[-1] == "EXIT" and len(ins) == 8
    renamed = LISTING.replace("ILi0EEv", "EEv").replace("/*0010*/", "/*0110*/")
    assert cuda_sass.instructions(renamed) == ins
    assert cuda_sass.instructions(LISTING.replace("0x200", "0x400")) != ins


def test_main_loop_is_the_backward_branch_holding_an_mma():
    loop = cuda_sass.main_loop(LISTING)
    assert loop[0].startswith("LDG") and loop[-1].endswith("BRA 0x20") and len(loop) == 4
    with pytest.raises(RuntimeError, match="no loop"):
        cuda_sass.main_loop(LISTING.replace("HMMA", "FFMA"))
    # wgmma kernels: the loop holding an HGMMA, which the default does not count
    wg = LISTING.replace("HMMA.16816.F32.BF16 R8, R4, R6, R8", "HGMMA.64x16x16.F32.BF16 R24, R32, gdesc[UR8], R24")
    assert cuda_sass.main_loop(wg, "HGMMA")[1].startswith("HGMMA")
    with pytest.raises(RuntimeError, match="no loop"):
        cuda_sass.main_loop(wg)


def test_source_of_a_copy(tmp_path):
    copy = tmp_path / "old.py"
    copy.write_text('SOURCE = DEVICE_HELPERS + r"""\n__global__ void k() {}\n"""\n')
    src = cuda_sass.source_of(str(copy))
    assert src.endswith("__global__ void k() {}\n") and "griddepcontrol" in src  # the current DEVICE_HELPERS prepended
    copy.write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no SOURCE"):
        cuda_sass.source_of(str(copy))
