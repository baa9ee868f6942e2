"""The Gluon sm_90 kernels compile on this (GPU-less) machine, and their SASS shows what they
were built for: wgmma (HGMMA), TMA loads (UTMALDG), no local-memory spills, shared memory within
one SM's 227 KB. Compiled in a child process, as in test_triton_sm90.py."""
import json
import pathlib
import subprocess

import pytest

pytest.importorskip("triton.experimental.gluon")

from tests.backends.test_triton_sm90 import _resources, _run_child  # noqa: E402

SCAN_POINTERS = {"beta": "*bf16", "rq": "*fp32", "rk": "*fp32", "gcum": "*fp32", "o": "*bf16", "h0": "*fp32",
                 "ht": "*fp32", "h_chunks": "*bf16", "cu_seqlens": "*i64", "chunk_start": "*i64", "segments": "*i32",
                 "seg_state": "*fp32"}
SCAN_VARIANTS = {
    # name: constexprs over the default launch (K = V = 128, BV 32, two stages, whole sequences)
    "bv32": {},
    "bv64": dict(BV=64),
    "bv64-replay-varlen": dict(BV=64, SEG=2, VARLEN=True),
    "bv32-replay-states-varlen": dict(SEG=2, STORE_STATES=True, VARLEN=True),
    "k64-v-first": dict(K=64, V=64, SK=1, SV=64),
}


def _child_scan(name: str, folder: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from fastla.backends.gluon.chunk_delta_sm90 import _scan_sm90_kernel as kern

    consts = dict(H=16, HV=64, K=128, V=128, BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, L2NORM=True,
                  VARLEN=False, SEG=0, BETA=2, STORE_STATES=False, STAGES=2)
    consts.update(SCAN_VARIANTS[name])
    tile = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    vtile = gl.NVMMASharedLayout.get_default_for([64, consts["BV"]], gl.bfloat16)
    names = kern.arg_names
    sig = {}
    for n in names:
        if n in ("k_desc", "q_desc", "p_desc", "a_desc"):
            sig[n] = f"tensordesc<bf16[64, 64],{tile!r}>"
        elif n == "v_desc":
            sig[n] = f"tensordesc<bf16[64, {consts['BV']}],{vtile!r}>"
        else:
            sig[n] = SCAN_POINTERS.get(n) or ("constexpr" if n in consts else ("i32" if n in ("T", "NT") else "fp32"))
    src = GluonASTSource(kern, sig, {(names.index(n),): v for n, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    res = _resources(kernel.asm["cubin"], folder)
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(pathlib.Path(folder) / "k.cubin")], capture_output=True,
                          text=True, check=True).stdout
    res.update(hgmma=sass.count("HGMMA"), utmaldg=sass.count("UTMALDG"), shared_bytes=kernel.metadata.shared)
    print(json.dumps(res))


@pytest.mark.parametrize("name", list(SCAN_VARIANTS))
def test_gdn_scan_compiles_for_sm90(name, tmp_path):
    res = _run_child(f"_child_scan({name!r}, {str(tmp_path)!r})", tmp_path, module="tests.backends.test_gluon_sm90")
    assert res["hgmma"] > 0 and res["utmaldg"] > 0, res
    assert res["LOCAL"] == 0 and res["STACK"] == 0, f"spills: {res}"
    assert res["shared_bytes"] <= 227 * 1024, res
