"""The Triton kernels compile for sm_90 on this (GPU-less) machine, with no local-memory spills,
vectorised state loads, and a bounded register count.

The compile runs in a child process: the test session itself uses the Triton interpreter
(``TRITON_INTERPRET=1``), under which kernels are not compilable objects.
"""
import contextlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

POINTERS = {
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "gk": "*fp32", "beta": "*bf16", "A_log": "*fp32",
    "dt_bias": "*fp32", "g_gamma": "*fp32", "o": "*bf16", "h0": "*fp32", "ht": "*fp32", "cu_seqlens": "*i64",
    "slots": "*i32", "accepted": "*i32",
}
BASE = dict(H=16, HV=32, K=128, V=128, BK=128, BV=32, SK=128, SV=1, DELTA=True, HAS_G=True, HAS_GK=False,
            HAS_GAMMA=False, GATE=1, HAS_A=True, HAS_BIAS=True, L2NORM=True, BETA=2, VARLEN=False, POOL=1,
            ACCEPTED=False, HAS_H0=True, WRITE=True)
VARIANTS = {
    "gdn-pool-bv32": ({}, 4),
    "gdn-pool-bv8": ({"BV": 8}, 1),
    "kda-bounded-varlen": ({"HAS_G": False, "HAS_GK": True, "GATE": 3, "VARLEN": True}, 4),
    "gdn-per-token-bf16-state": ({"POOL": 2, "ACCEPTED": True}, 4),
    "gla-plain": ({"DELTA": False, "GATE": 0, "HAS_G": False, "HAS_GK": True, "HAS_A": False, "HAS_BIAS": False,
                   "L2NORM": False, "BETA": 0, "POOL": 0}, 4),
}


def _compile(constexprs: dict, num_warps: int, state="*fp32"):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastla.backends.triton.recurrent import _recurrent_fwd_kernel

    names = _recurrent_fwd_kernel.arg_names
    pointers = dict(POINTERS, h0=state, ht=state)
    sig = {}
    for n in names:
        if n in pointers:
            sig[n] = pointers[n]
        elif n in constexprs:
            sig[n] = "constexpr"
        elif n in ("scale", "lower_bound"):
            sig[n] = "fp32"
        else:
            sig[n] = "i64"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    src = ASTSource(_recurrent_fwd_kernel, sig, {(names.index(n),): v for n, v in constexprs.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def cuobjdump(flag: str, cubin: bytes, folder: str) -> str:
    """Triton's cuobjdump on ``cubin`` (written to ``folder``/k.cubin): ``-sass``, ``-res-usage``."""
    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = pathlib.Path(folder) / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes, folder: str) -> dict:
    out = cuobjdump("-res-usage", cubin, folder)
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def _child(name: str, folder: str) -> None:
    """Runs in the child: compile one variant, print its resources and PTX facts as JSON."""
    over, warps = VARIANTS[name]
    state = "*bf16" if "bf16-state" in name else "*fp32"
    kernel = _compile({**BASE, **over}, warps, state)
    res = _resources(kernel.asm["cubin"], folder)
    ptx = kernel.asm["ptx"]
    res["vector_loads"] = ptx.count("ld.global.v4") + ptx.count("ld.global.v2")
    print(json.dumps(res))


SCAN_POINTERS = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*bf16", "p_in": "*bf16", "a_in": "*bf16",
                 "rq": "*fp32", "rk": "*fp32", "gcum": "*fp32", "kd": "*bf16", "decay": "*fp32", "o": "*bf16",
                 "h0": "*fp32",
                 "ht": "*fp32", "h_chunks": "*bf16", "cu_seqlens": "*i64", "chunk_start": "*i64", "segments": "*i32",
                 "seg_state": "*fp32"}
KDA_PREPARE_POINTERS = {"q": "*bf16", "k": "*bf16", "g": "*bf16", "beta": "*bf16", "A_log": "*fp32",
                        "dt_bias": "*fp32", "p_out": "*bf16", "a_out": "*bf16", "kg": "*bf16", "kd": "*bf16",
                        "qg": "*bf16", "decay": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32"}
COMBINE_POINTERS = {"summary": "*fp32", "seg_start": "*fp32", "h0": "*fp32", "seq_segments": "*i32"}
COMBINE_FLAGS = dict(SK=128, SV=1, HAS_H0=True, ALL_SUMMARIES=False)
BWD_POINTERS = {
    "reverse": {"q": "*bf16", "k": "*bf16", "kd": "*bf16", "decay": "*fp32", "beta": "*fp32", "p_in": "*bf16", "a_in": "*bf16", "gcum": "*fp32",
                "do": "*bf16", "dht": "*fp32", "dh_chunks": "*bf16", "r_out": "*fp32", "dh0": "*fp32",
                "cu_seqlens": "*i64", "chunk_start": "*i64"},
    "value": {"q": "*bf16", "k": "*bf16", "v": "*bf16", "beta": "*fp32", "p_in": "*bf16", "gcum": "*fp32",
              "h": "*bf16", "do": "*bf16", "r_in": "*fp32", "vn_out": "*bf16",
              "dqk_out": "*bf16", "dkk_out": "*bf16", "dv": "*bf16", "dG_out": "*fp32", "dbeta": "*fp32",
              "cu_seqlens": "*i64", "chunk_index": "*i32"},
    "key": {"q": "*bf16", "k": "*bf16", "beta": "*fp32", "gcum": "*fp32", "h": "*bf16", "dh_chunks": "*bf16",
            "do": "*bf16", "r_in": "*fp32", "vn_in": "*bf16", "dqk_in": "*bf16", "dkk_in": "*bf16", "dG_in": "*fp32",
            "dq": "*fp32", "dk": "*fp32", "dg": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32"},
}
KDA_GATE_POINTERS = {"g_raw": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "gk": "*fp32", "dgk": "*fp32",
                     "dg_raw": "*bf16", "dbias_part": "*fp32", "dA_part": "*fp32"}
CHANNEL_BWD_POINTERS = {
    "q": "*bf16", "k": "*bf16", "kg": "*bf16", "v": "*bf16", "beta": "*fp32", "p_in": "*bf16", "gcum": "*fp32",
    "h": "*bf16", "dh_chunks": "*bf16", "do": "*bf16", "r_in": "*fp32", "vn_out": "*bf16", "vn_in": "*bf16",
    "dqk_out": "*fp32", "dkk_out": "*fp32", "dqk": "*fp32", "dkk": "*fp32", "dv": "*bf16", "dbeta": "*fp32",
    "dq": "*fp32", "dk": "*fp32", "dG": "*fp32", "x": "*fp32", "out": "*fp32", "cu_seqlens": "*i64",
    "chunk_index": "*i32",
}
GDN_KERNELS = {
    # name: (module.kernel, pointers, constexprs, warps, stages) as launched (K = V = 128, bf16)
    "inverse": ("chunk_prepare._inverse_kernel",
                {"k": "*bf16", "g": "*bf16", "beta": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "p_out": "*bf16",
                 "gcum": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32"},
                dict(BK=64, VPP=4, GATE=True, HAS_BIAS=True, BETA=2), 1, 1),
    "scores": ("chunk_prepare._scores_kernel",
               {"q": "*bf16", "k": "*bf16", "gcum": "*fp32", "a_out": "*bf16", "rq_out": "*fp32", "rk_out": "*fp32",
                "cu_seqlens": "*i64", "chunk_index": "*i32"}, {}, 4, 1),
    "scan": ("chunk_delta._scan_kernel", SCAN_POINTERS,
             dict(BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=0, BETA=2, STORE_STATES=False, GK=False),
             4, 2),
    "scan-replay-3-stages": ("chunk_delta._scan_kernel", SCAN_POINTERS,
                             dict(BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=2, BETA=2,
                                  STORE_STATES=True, GK=False), 4, 3),
    "scan-summary": ("chunk_delta._scan_kernel", SCAN_POINTERS,
                     dict(BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=1, BETA=2, STORE_STATES=False,
                          GK=False), 4, 2),
    "kda-prepare": ("chunk_prepare_kda._kda_prepare_kernel",
                    {"q": "*bf16", "k": "*bf16", "g": "*bf16", "beta": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32",
                     "p_out": "*bf16", "a_out": "*bf16", "kg": "*bf16", "kd": "*bf16", "qg": "*bf16",
                     "decay": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32"},
                    dict(BK=16, GATE=3, HAS_A=True, HAS_BIAS=True, BETA=2, SCORES=False, EXACT=True),
                    1, 1),
    "kda-prepare-scores": ("chunk_prepare_kda._kda_prepare_kernel",
                           {"q": "*bf16", "k": "*bf16", "g": "*bf16", "beta": "*bf16", "A_log": "*fp32",
                            "dt_bias": "*fp32", "p_out": "*bf16", "a_out": "*bf16", "kg": "*bf16", "kd": "*bf16",
                            "qg": "*bf16", "decay": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32"},
                           dict(BK=16, GATE=3, HAS_A=True, HAS_BIAS=True, BETA=2, SCORES=True, EXACT=False), 1, 1),
    # the gate given precomputed (bf16, chunk_kda's default) and the softplus gate in the op, both
    # with the exact diagonal compiled in (gates without a lower bound)
    "kda-prepare-given-gate": ("chunk_prepare_kda._kda_prepare_kernel", KDA_PREPARE_POINTERS,
                               dict(BK=16, GATE=0, HAS_A=False, HAS_BIAS=False, BETA=2, SCORES=False, EXACT=True),
                               1, 1),
    "kda-prepare-scores-given-gate": ("chunk_prepare_kda._kda_prepare_kernel", KDA_PREPARE_POINTERS,
                                      dict(BK=16, GATE=0, HAS_A=False, HAS_BIAS=False, BETA=2, SCORES=True,
                                           EXACT=True), 1, 1),
    "kda-prepare-softplus-gate": ("chunk_prepare_kda._kda_prepare_kernel", KDA_PREPARE_POINTERS,
                                  dict(BK=16, GATE=2, HAS_A=True, HAS_BIAS=True, BETA=2, SCORES=True, EXACT=True),
                                  1, 1),
    # the blocks the sm_90 prologue flags (unbounded gates past its span limit), exactly
    "kda-wide-blocks": ("chunk_prepare_kda_wide._kda_wide_blocks_kernel",
                        {"q": "*bf16", "k": "*bf16", "g": "*bf16", "beta": "*bf16", "A_log": "*fp32",
                         "dt_bias": "*fp32", "a_kk": "*fp32", "a_qk": "*bf16", "kg": "*bf16", "kd": "*bf16",
                         "qg": "*bf16", "flags": "*i32", "items": "*i32", "count": "*i32", "cu_seqlens": "*i64",
                         "chunk_index": "*i32"},
                        dict(BK=16, GATE=2, HAS_A=True, HAS_BIAS=True, BETA=2), 4, 1),
    # P from the sm_90 prologue's A (the diagonal blocks' rows loaded as the substitution needs them),
    # and P diag(beta) for the scan that forms the gated keys (gluon/chunk_delta.BETA_IN_P)
    "kda-inverse": ("chunk_prepare_kda._kda_inverse_kernel",
                    {"a": "*fp32", "p_out": "*bf16", "beta": "*bf16", "cu_seqlens": "*i64", "chunk_index": "*i32"},
                    dict(BETA=2, BETA_COLS=False), 1, 1),
    "kda-inverse-beta-cols": ("chunk_prepare_kda._kda_inverse_kernel",
                              {"a": "*fp32", "p_out": "*bf16", "beta": "*bf16", "cu_seqlens": "*i64",
                               "chunk_index": "*i32"}, dict(BETA=2, BETA_COLS=True), 1, 1),
    # the segment combine, as the portable tier launches it and as the sm_90 tier does
    "combine": ("chunk_delta._segment_combine_kernel", COMBINE_POINTERS, COMBINE_FLAGS | dict(BV=32), 4, 1),
    "combine-sm90": ("chunk_delta._segment_combine_kernel", COMBINE_POINTERS, COMBINE_FLAGS | dict(BV=16), 8, 2),
    "kda-wide-list": ("chunk_prepare_kda_wide._list_blocks_kernel",
                      {"flags": "*i32", "items": "*i32", "count": "*i32"}, {}, 4, 1),
    "kda-scan": ("chunk_delta._scan_kernel", SCAN_POINTERS,
                 dict(BV=64, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=0, BETA=2, STORE_STATES=False,
                      L2NORM=False, GK=True), 8, 2),
    # the plain rule (Simple GLA, Lightning): the scan without the delta correction, its summary
    # pass, and the scalar gate's cumsum (chunk_prepare.launch_gate_cumsum)
    "plain-scan": ("chunk_delta._scan_kernel", SCAN_POINTERS,
                   dict(BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=0, BETA=1, STORE_STATES=False,
                        L2NORM=False, GK=False, DELTA=False, H=32), 4, 2),
    "plain-scan-summary": ("chunk_delta._scan_kernel", SCAN_POINTERS,
                           dict(BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=1, BETA=1,
                                STORE_STATES=False, L2NORM=False, GK=False, DELTA=False, H=32), 4, 2),
    "plain-gla-prepare": ("chunk_prepare_kda._kda_prepare_kernel", KDA_PREPARE_POINTERS,
                          dict(BK=16, GATE=0, HAS_A=False, HAS_BIAS=False, BETA=1, SCORES=False, EXACT=True,
                               DELTA=False, L2NORM=False, H=32), 1, 1),
    "plain-gla-wide-blocks": ("chunk_prepare_kda_wide._kda_wide_blocks_kernel",
                              {"q": "*bf16", "k": "*bf16", "g": "*bf16", "beta": "*fp32", "A_log": "*fp32",
                               "dt_bias": "*fp32", "a_kk": "*fp32", "a_qk": "*bf16", "kg": "*fp32", "kd": "*bf16",
                               "qg": "*bf16", "flags": "*i32", "items": "*i32", "count": "*i32", "cu_seqlens": "*i64",
                               "chunk_index": "*i32"},
                              dict(BK=16, GATE=0, HAS_A=False, HAS_BIAS=False, BETA=1, DELTA=False, L2NORM=False,
                                   H=32), 4, 1),
    "plain-gla-scan": ("chunk_delta._scan_kernel", SCAN_POINTERS,
                       dict(BV=64, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, SEG=0, BETA=1, STORE_STATES=False,
                            L2NORM=False, GK=True, DELTA=False, H=32), 8, 2),
    # the backward (chunk_delta_backward.py): the reverse state-gradient scan and the per-chunk gradients
    "bwd-reverse-scan": ("chunk_delta_backward._reverse_scan_kernel", BWD_POINTERS["reverse"],
                         dict(BV=16, HAS_DHT=True, STORE_DH0=True, GK=False), 4, 2),
    "bwd-value-grads": ("chunk_delta_backward._value_grads_kernel", BWD_POINTERS["value"], dict(BV=32), 8, 2),
    "bwd-key-grads": ("chunk_delta_backward._key_grads_kernel", BWD_POINTERS["key"], dict(BK=128, BV=32), 8, 1),
    # (the plain rule's backward: Simple GLA, Lightning)
    "bwd-plain-reverse-scan": ("chunk_delta_backward._reverse_scan_kernel", BWD_POINTERS["reverse"],
                               dict(BV=16, HAS_DHT=True, STORE_DH0=True, DELTA=False, GK=False), 4, 2),
    "bwd-plain-value-grads": ("chunk_delta_backward._value_grads_kernel", BWD_POINTERS["value"],
                              dict(BV=32, DELTA=False), 8, 2),
    "bwd-plain-key-grads": ("chunk_delta_backward._key_grads_kernel", BWD_POINTERS["key"],
                            dict(BK=128, BV=32, DELTA=False), 8, 1),
    # (the q/k ends, qk_grads.py: l2norm rows, GVA's sum and the l2norm's backward; no products)
    "bwd-qk-normalize": ("qk_grads._normalize_kernel", {"q": "*bf16", "k": "*bf16", "qn": "*bf16", "kn": "*bf16"},
                         dict(BLOCK_T=16), 4, 1),
    "bwd-qk-input-grads": ("qk_grads._input_grads_kernel",
                           {"q": "*bf16", "k": "*bf16", "dq_v": "*fp32", "dk_v": "*fp32", "dq": "*bf16", "dk": "*bf16"},
                           dict(G=2, BLOCK_T=16, NORM=True), 4, 1),
    # (the per-channel backward, chunk_channel_backward.py: KDA, and GLA's plain rule)
    "bwd-kda-reverse-scan": ("chunk_delta_backward._reverse_scan_kernel", BWD_POINTERS["reverse"],
                             dict(BV=32, HAS_DHT=True, STORE_DH0=True, GK=True), 8, 1),
    "bwd-kda-value-grads": ("chunk_channel_backward._channel_value_grads_kernel", CHANNEL_BWD_POINTERS,
                            dict(BV=32), 8, 1),
    "bwd-kda-key-grads": ("chunk_channel_backward._channel_key_grads_kernel", CHANNEL_BWD_POINTERS,
                          dict(BK=32, BV=32), 4, 1),
    # (the value kernel's tiles where others went wrong on an H100, chunk_channel_backward.value_block:
    # GLA in one tile, at K = V = 64 and 128; KDA at V = 32 in 16-column ones)
    "bwd-gla-value-grads-k64": ("chunk_channel_backward._channel_value_grads_kernel", CHANNEL_BWD_POINTERS,
                                dict(K=64, V=64, BK=64, BV=64, DELTA=False, VARLEN=True, HV=3), 8, 1),
    "bwd-gla-value-grads": ("chunk_channel_backward._channel_value_grads_kernel", CHANNEL_BWD_POINTERS,
                            dict(BV=128, DELTA=False), 8, 1),
    "bwd-kda-value-grads-v32": ("chunk_channel_backward._channel_value_grads_kernel", CHANNEL_BWD_POINTERS,
                                dict(K=64, V=32, BK=64, BV=16, VARLEN=True, HV=4), 8, 1),
    "bwd-gla-key-grads-k64": ("chunk_channel_backward._channel_key_grads_kernel", CHANNEL_BWD_POINTERS,
                              dict(K=64, V=64, BK=32, BV=32, DELTA=False, VARLEN=True, H=3, HV=3), 4, 1),
    # (its diagonal blocks on fp32 products where their span allows, else a row and a column at a
    # time; the loops alone, SCORE_DIAGONAL_PRODUCTS off)
    "bwd-kda-score-grads": ("chunk_channel_backward._channel_score_grads_kernel", CHANNEL_BWD_POINTERS,
                            dict(BK=32, DIAG_PRODUCTS=True), 4, 1),
    "bwd-gla-score-grads": ("chunk_channel_backward._channel_score_grads_kernel", CHANNEL_BWD_POINTERS,
                            dict(BK=32, DELTA=False, DIAG_PRODUCTS=True), 4, 1),
    "bwd-kda-score-grads-loops": ("chunk_channel_backward._channel_score_grads_kernel", CHANNEL_BWD_POINTERS,
                                  dict(BK=32, DIAG_PRODUCTS=False), 4, 1),
    # (the training path's KDA gate, gate_grads.py: the bounded gate with A_log and dt_bias)
    "bwd-kda-gate": ("gate_grads._gate_kernel", KDA_GATE_POINTERS,
                     dict(BK=128, BLOCK_T=32, BOUNDED=True, HAS_A=True, HAS_BIAS=True), 4, 1),
    "bwd-kda-gate-grads": ("gate_grads._gate_grads_kernel", KDA_GATE_POINTERS,
                           dict(BK=128, BLOCK_T=32, BOUNDED=True, HAS_A=True, HAS_BIAS=True), 4, 1),
    "bwd-channel-cumsum": ("chunk_channel_backward._channel_cumsum_kernel", CHANNEL_BWD_POINTERS,
                           dict(BK=32, REVERSE=True), 4, 1),
    "plain-gate-cumsum": ("chunk_prepare._gate_cumsum_kernel",
                          {"g": "*fp32", "g_gamma": "*fp32", "gcum": "*fp32", "cu_seqlens": "*i64",
                           "chunk_index": "*i32"}, dict(HAS_G=True, HAS_GAMMA=True, VARLEN=True), 1, 1),
}


def _child_gdn(name: str, folder: str) -> None:
    """Runs in the child: compile one of the GDN chunk kernels as launched by default."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import importlib

    kname, ptrs, extra, warps, stages = GDN_KERNELS[name]
    module, attr = kname.split(".")
    kern = getattr(importlib.import_module(f"fastla.backends.triton.{module}"), attr)
    consts = {**dict(H=16, HV=32, K=128, V=128, BT=64, BK=128, DOT=tl.bfloat16, L2NORM=True, VARLEN=False,
                     DELTA=True), **extra}
    if isinstance(consts["DOT"], str):                                # a product dtype by name
        consts["DOT"] = getattr(tl, consts["DOT"])
    names = kern.arg_names
    consts = {n: c for n, c in consts.items() if n in names}
    # (constexpr parameters left at their defaults compile as those constants, as a launch does)
    consts.update({q.name: q.default for q in kern.params
                   if q.is_constexpr and q.name not in consts and q.default is not inspect.Parameter.empty})
    ptrs = {n: t for n, t in ptrs.items() if n in names}            # (a shared table: this kernel's)
    ints = ("T", "NT", "total", "n_flags", "rows")
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else ("i32" if n in ints else "fp32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = ASTSource(kern, sig, {(names.index(n),): v for n, v in consts.items()}, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    build = contextlib.nullcontext({})
    if getattr(kern, "fastla_newer_ptxas", False):        # assembled as its launches are (launch.py)
        from fastla.backends.triton import launch

        build = launch.newer_ptxas_build()
    with build as extra_options:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**options, **extra_options})
    res = _resources(kernel.asm["cubin"], folder)
    sass = cuobjdump("-sass", kernel.asm["cubin"], folder)
    res["hgmma"] = sass.count("HGMMA")
    res["dropped_products"] = dropped_products(kernel.asm["ptx"], sass)
    res["hmma"] = sass.count("HMMA")
    res["shared_bytes"] = kernel.metadata.shared
    print(json.dumps(res))


def dropped_products(ptx: str, sass: str) -> str | None:
    """What an sm_90 build lost of the products its PTX asks for, or None: a placeholder HGMMA
    (ptxas's stand-in for a warpgroup's products it removed: no descriptor, no registers) or fewer
    HGMMAs than wgmmas (ptxas may copy some, never drops one legitimately)."""
    wgmma = ptx.count("wgmma.mma_async")
    hgmma = sass.count("HGMMA")
    placeholders = len(re.findall(r"HGMMA\S* RZ, gdesc\[URZ\]", sass))
    if placeholders or hgmma < wgmma:
        return f"{wgmma} wgmma in the PTX, {hgmma} HGMMA in the SASS ({placeholders} placeholders)"
    return None


def _run_child(call: str, tmp_path, module: str = "tests.backends.test_triton_sm90") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    code = f"from {module} import {call.split('(')[0]}; {call}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])



@pytest.mark.parametrize("name", list(GDN_KERNELS))
def test_gdn_chunk_kernels_compile_for_sm90(name, tmp_path):
    """Tensor-core products in the SASS (wgmma; mma.sync for the prologues' 16x16 blocks, too small
    for a warpgroup; none in the wide-block kernel, fp32 on purpose), within Hopper's 227 KB of
    shared memory, spills bounded."""
    res = _run_child(f"_child_gdn({name!r}, {str(tmp_path)!r})", tmp_path)
    # no tensor-core products: fp32 FMA products (ieee), a list, a cumsum, GLA's kd and decay, the
    # training path's element-wise ends
    if not name.startswith(("kda-wide", "plain-gate", "plain-gla-prepare", "plain-gla-wide", "bwd-channel-cumsum",
                            "bwd-qk", "bwd-kda-gate")):
        # (the backward's score kernels: [16, BT] x [BT, 16] products per 16-token block)
        small = name in ("inverse", "kda-inverse", "kda-inverse-beta-cols") or name.startswith(("kda-prepare", "bwd-kda-score", "bwd-gla-score"))
        assert (res["hmma"] if small else res["hgmma"]) > 0, res
    # every product the PTX asks for is in the SASS (ptxas may copy some, never drops one): ptxas
    # 12.8 and 12.9 both dropped the GLA value kernel's at K = V = 64 in two 32-column tiles (the
    # loop unrolled, its sums zero-initialised, then masked), which left dA_qk zero
    # (docs/notes/chunk-backward.md)
    assert res["dropped_products"] is None, res
    assert res["shared_bytes"] <= 227 * 1024, res
    assert res["LOCAL"] == 0, res
    assert res["STACK"] <= KNOWN_STACK.get(name, 0), res


# Spills known and left: the KDA prologue with a precomputed gate sits at 255 registers at one
# warp and spills 8 bytes in both launches (docs/notes/kda-prefill.md); so does the GDN inverse
# with its diagonal rows read back from memory (measured faster: 1x32k HV64 478 -> 366 us,
# docs/notes/gdn-prefill.md); the other builds none
KNOWN_STACK = {"kda-prepare-given-gate": 8, "kda-prepare-scores-given-gate": 8, "inverse": 8}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_kernel_compiles_for_sm90(name, tmp_path):
    res = _run_child(f"_child({name!r}, {str(tmp_path)!r})", tmp_path)
    assert res["LOCAL"] == 0 and res["STACK"] == 0, f"spills: {res}"
    assert res["REG"] <= 128, f"register use grew: {res}"
    assert res["vector_loads"] > 0, f"state loads are not vectorised: {res}"
