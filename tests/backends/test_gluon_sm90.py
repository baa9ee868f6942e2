"""The Gluon sm_90 kernels compile on this (GPU-less) machine, and their SASS shows what they
were built for: wgmma (HGMMA), TMA loads (UTMALDG), no local-memory spills, shared memory within
one SM's 227 KB. Compiled in a child process, as in test_triton_sm90.py."""
import json

import pytest

pytest.importorskip("triton.experimental.gluon")

from tests.backends.test_triton_sm90 import _resources, _run_child, cuobjdump, dropped_products  # noqa: E402


def _compile_sm90(kern, sig: dict, consts: dict, folder: str, options: dict, aligned: tuple = ()) -> dict:
    """Compile a Gluon kernel for sm_90 as a launch specializes it (every pointer argument 16-byte
    aligned: fresh tensors, and the Gluon tier's TMA needs it): the cubin's resources and its SASS
    counts of wgmma, TMA loads and stores, 16-byte global stores, the shared memory and the PTX's
    register splits. ``aligned``: integer arguments a launch specializes as multiples of 16. Fails
    where ptxas dropped products the PTX asks for (test_triton_sm90.dropped_products)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kern.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if isinstance(t, str) and t.startswith("*") or n in aligned}
    src = GluonASTSource(kern, sig, {(names.index(n),): v for n, v in consts.items()}, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    res = _resources(kernel.asm["cubin"], folder)
    sass = cuobjdump("-sass", kernel.asm["cubin"], folder)
    dropped = dropped_products(kernel.asm["ptx"], sass)
    assert dropped is None, f"{kern.fn.__name__}: {dropped}"
    res.update(hgmma=sass.count("HGMMA"), hmma=sass.count("HMMA"), stg128=sass.count("STG.E.128"),
               utmaldg=sass.count("UTMALDG"),
               utmastg=sass.count("UTMASTG"), shared_bytes=kernel.metadata.shared,
               setmaxnreg=kernel.asm["ptx"].count("setmaxnreg"))
    return res

SCAN_POINTERS = {"beta": "*bf16", "rq": "*fp32", "rk": "*fp32", "gcum": "*fp32", "decay": "*fp32", "o": "*bf16",
                 "h0": "*fp32",
                 "ht": "*fp32", "h_chunks": "*bf16", "cu_seqlens": "*i64", "chunk_start": "*i64", "segments": "*i32",
                 "seg_state": "*fp32", "A_log": "*fp32", "dt_bias": "*fp32"}
SCAN_VARIANTS = {
    # name: constexprs over the default launch (K = V = 128, BV 32, two stages, whole sequences)
    "bv32": {},
    "bv64": dict(BV=64),
    "bv64-replay-varlen": dict(BV=64, SEG=2, VARLEN=True),
    "bv32-replay-states-varlen": dict(SEG=2, STORE_STATES=True, VARLEN=True),
    "k64-v-first": dict(K=64, V=64, SK=1, SV=64),
    "bv128-two-warpgroups": dict(BV=128, WARPGROUPS=2),
    "bv128-replay-varlen": dict(BV=128, WARPGROUPS=2, SEG=2, VARLEN=True),
    # KDA's per-channel step (GK): 32 and 64 columns
    "kda-bv64": dict(BV=64, GK=True, L2NORM=False),
    "kda-bv32-replay-states-varlen": dict(GK=True, L2NORM=False, SEG=2, STORE_STATES=True, VARLEN=True),
    "kda-k64-v-first": dict(GK=True, L2NORM=False, K=64, V=64, SK=1, SV=64),
    # the warp-specialized scan (chunk_delta_ws_sm90.py): 32 and 64 columns
    "ws-bv32": dict(WS=True),
    "ws-bv64": dict(WS=True, BV=64),
    "ws-bv64-replay-varlen": dict(WS=True, BV=64, SEG=2, VARLEN=True),
    "ws-bv32-replay-states-varlen": dict(WS=True, SEG=2, STORE_STATES=True, VARLEN=True),
    "ws-k64-v-first-raw-beta": dict(WS=True, K=64, V=64, SK=1, SV=64, BETA=1, L2NORM=False),
    # two chains per program (chunk_delta_dual_sm90.py): 64 columns as two of 32
    "dual-bv64": dict(DUAL=True, BV=64),
    "dual-bv32": dict(DUAL=True, BV=32),
    "dual-bv128": dict(DUAL=True, BV=128),
    "dual-bv64-replay-states-varlen": dict(DUAL=True, BV=64, SEG=2, STORE_STATES=True, VARLEN=True),
    "dual-k64-v-first": dict(DUAL=True, BV=64, K=64, V=64, SK=1, SV=64),
    "dual-kda-bv64": dict(DUAL=True, BV=64, GK=True, L2NORM=False),
    "dual-kda-bv32": dict(DUAL=True, BV=32, GK=True, L2NORM=False),
    # the segment summary pass (SEG 1: the V + K columns [0 | I], no output) on the two chains
    "dual-bv64-summary-varlen": dict(DUAL=True, BV=64, SEG=1, VARLEN=True),
    "dual-kda-bv64-summary": dict(DUAL=True, BV=64, SEG=1, GK=True, L2NORM=False),
    # the plain rule (DELTA False: Simple GLA and Lightning; GLA with GK): both scans, its summary
    "plain-bv32": dict(DELTA=False, L2NORM=False, H=64),
    "dual-plain-bv64": dict(DUAL=True, BV=64, DELTA=False, L2NORM=False, H=64),
    "dual-plain-bv32-summary-varlen": dict(DUAL=True, SEG=1, VARLEN=True, DELTA=False, L2NORM=False, H=64),
    "gla-bv32": dict(GK=True, DELTA=False, L2NORM=False),
    "dual-gla-bv64": dict(DUAL=True, BV=64, GK=True, DELTA=False, L2NORM=False),
    "dual-gla-bv64-summary": dict(DUAL=True, BV=64, SEG=1, GK=True, DELTA=False, L2NORM=False),
    # the state in registers (chunk_delta_regs_sm90.py: transposed products, 64 columns a program)
    "regs": dict(REGS=True, BV=64),
    "regs-replay-varlen": dict(REGS=True, BV=64, SEG=2, VARLEN=True),
    "regs-k64-v-first-raw-beta": dict(REGS=True, BV=64, K=64, V=64, SK=1, SV=64, BETA=1, L2NORM=False),
    "regs-kda": dict(REGS=True, BV=64, GK=True, L2NORM=False),
    "regs-kda-replay-varlen": dict(REGS=True, BV=64, GK=True, L2NORM=False, SEG=2, VARLEN=True),
    "regs2": dict(REGS=True, BV=128),
    "regs2-kda": dict(REGS=True, BV=128, GK=True, L2NORM=False),
    # the scores formed in the chains (QK: no scores kernel, no A_qk tile)
    "regs-qk": dict(REGS=True, BV=64, QK=True),
    "regs-qk-replay-varlen": dict(REGS=True, BV=64, SEG=2, VARLEN=True, QK=True),
    "regs-qk-k64-v-first-raw-beta": dict(REGS=True, BV=64, K=64, V=64, SK=1, SV=64, BETA=1, L2NORM=False, QK=True),
    "regs2-qk": dict(REGS=True, BV=128, QK=True),       # (the second chain forms them for both)
    # KDA's gated keys and queries formed in the scan by a gater warpgroup (the bounded gate in the op),
    # their products as shipped (GATER_PACKED: bf16 pairs) unless the variant says, and on fp32
    "regs-kda-gates": dict(REGS=True, BV=64, GK=True, GATES=True, HAS_A=True, HAS_BIAS=True),
    "regs-kda-gates-fp32": dict(REGS=True, BV=64, GK=True, GATES=True, HAS_A=True, HAS_BIAS=True, PACKED=False),
    "regs-kda-gates-varlen-k64-bare": dict(REGS=True, BV=64, GK=True, GATES=True, K=64, V=64, SK=1, SV=64,
                                           VARLEN=True, L2NORM=False, BETA=1),
}


def _child_scan(name: str, folder: str) -> None:
    from triton.experimental.gluon import language as gl

    from fastla.backends.gluon.chunk_delta_sm90 import _scan_sm90_kernel
    from fastla.backends.gluon.chunk_delta_dual_sm90 import CHAIN_REGS, LOADER_REGS, _scan_dual_sm90_kernel
    from fastla.backends.gluon.chunk_delta_ws_sm90 import PREP_REGS, _scan_ws_sm90_kernel
    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_delta_regs_sm90 as regs

    consts = dict(H=16, HV=64, K=128, V=128, BV=32, SK=128, SV=1, HAS_H0=True, STORE_FINAL=True, L2NORM=True,
                  VARLEN=False, SEG=0, BETA=2, STORE_STATES=False, STAGES=2, WARPGROUPS=1, GK=False, DELTA=True)
    consts.update(SCAN_VARIANTS[name])
    if consts.pop("WS", False):
        kern = _scan_ws_sm90_kernel
        del consts["WARPGROUPS"], consts["STAGES"], consts["GK"], consts["DELTA"]
        consts["PREP_NREG"] = PREP_REGS
    elif consts.pop("REGS", False):
        kern = regs._scan_regs_sm90_kernel
        consts.setdefault("QK", False)
        for n in ("GATES", "HAS_A", "HAS_BIAS"):
            consts.setdefault(n, False)
        consts.setdefault("PACKED", consts["GATES"] and gluon_chunk.GATER_PACKED)   # as launched
        consts.setdefault("WHOLE", gluon_chunk.WHOLE_CHUNK_BRANCHES)
        consts.setdefault("BETA_IN_P", (consts["QK"] or consts["GATES"]) and gluon_chunk.BETA_IN_P)   # as launched
        consts.update(CHAINS=consts["BV"] // 64, LOADER_NREG=regs.LOADER_REGS,
                      CHAIN_NREG=regs.CHAIN_REGS_QK if consts["QK"] else regs.CHAIN_REGS)
        for n in ("WARPGROUPS", "DELTA", "BV", "STORE_STATES"):
            del consts[n]
    elif consts.pop("DUAL", False):
        kern = _scan_dual_sm90_kernel
        del consts["WARPGROUPS"]
        consts.update(CHAIN_NREG=CHAIN_REGS, LOADER_NREG=LOADER_REGS)
    else:
        kern = _scan_sm90_kernel
    tile = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    box_v = consts["BV"] // 2 if kern is _scan_dual_sm90_kernel else consts.get("BV", regs.BV_REGS.value)   # (dual: chains')
    vtile = gl.NVMMASharedLayout.get_default_for([64, box_v], gl.bfloat16)
    names = kern.arg_names
    sig = {}
    for n in names:
        if n in ("k_desc", "q_desc", "kd_desc", "p_desc", "a_desc"):
            sig[n] = f"tensordesc<bf16[64, 64],{tile!r}>"
        elif n in ("v_desc", "o_desc"):
            sig[n] = f"tensordesc<bf16[64, {box_v}],{vtile!r}>"
        else:
            sig[n] = SCAN_POINTERS.get(n) or ("constexpr" if n in consts else ("i32" if n in ("T", "NT", "n_rows") else "fp32"))
    print(json.dumps(_compile_sm90(kern, sig, consts, folder, {"num_warps": 4 * consts.get("WARPGROUPS", 1)})))


# Spills allowed by name (bytes of stack): the two 64-column chains at 224 + 248 registers keep
# the values computed before the partitions fork on the stack (reloaded once, one in the loop);
# the state-in-registers scan keeps two words there (replay) and with two chains the final store's
# pointers (chains at 224 + 232 registers, the loader's warpgroup at 48): stored before the loop,
# reloaded after it; with the scores formed in the second chain (240 registers) 88 bytes, and in
# the scorer warpgroup of one chain's replays 40 bytes, and with KDA's two gater warpgroups (120
# registers each) 24 bytes, none of them in a loop
SCAN_SPILLS = {"dual-bv128": 64, "regs-replay-varlen": 8, "regs2": 72, "regs2-kda": 24, "regs2-qk": 88,
               "regs-qk-replay-varlen": 40, "regs-kda-gates": 24, "regs-kda-gates-fp32": 24}


@pytest.mark.parametrize("name", list(SCAN_VARIANTS))
def test_gdn_scan_compiles_for_sm90(name, tmp_path):
    res = _run_child(f"_child_scan({name!r}, {str(tmp_path)!r})", tmp_path, module="tests.backends.test_gluon_sm90")
    assert res["hgmma"] > 0 and res["utmaldg"] > 0, res                                # wgmma, TMA loads
    assert (res["utmastg"] > 0) != ("summary" in name), res        # the output's TMA store (a summary has none)
    assert res["LOCAL"] <= SCAN_SPILLS.get(name, 0) and res["STACK"] <= SCAN_SPILLS.get(name, 0), f"spills: {res}"
    assert res["shared_bytes"] <= 227 * 1024, res
    assert (res["setmaxnreg"] > 0) == name.startswith(("ws-", "dual-", "regs")), res   # the partitions' registers


DECODE_VARIANTS = {
    # name: (state dtype, constexprs over GDN's shipped launch: a bf16 pool, 64 columns, 2 stages)
    "gdn-bf16-pool": ("bf16", {}),
    "kda-bf16-pool": ("bf16", dict(HAS_G=False, HAS_GK=True, GATE=3)),
    "gla-fp32-v-first-fla-form": ("fp32", dict(V_FIRST=True, DELTA=False, HAS_G=False, HAS_GK=True, GATE=0,
                                                HAS_A=False, HAS_BIAS=False, L2NORM=False, BETA=0, POOL=False,
                                                STAGES=3)),
}


def _child_decode(name: str, folder: str) -> None:
    from triton.experimental.gluon import language as gl

    from fastla.backends.gluon.recurrent_sm90 import _decode_sm90_kernel as kern

    state, over = DECODE_VARIANTS[name]
    consts = dict(H=16, HV=32, K=128, V=128, BV=64, V_FIRST=False, DELTA=True, HAS_G=True, HAS_GK=False,
                  HAS_GAMMA=False, GATE=1, HAS_A=True, HAS_BIAS=True, L2NORM=True, BETA=2, POOL=True, STAGES=2)
    consts.update(over)
    box = [consts["BV"], consts["K"]] if consts["V_FIRST"] else [consts["K"], consts["BV"]]
    layout = gl.NVMMASharedLayout(0, 32 if state == "fp32" else 16, 2)
    sig = {}
    for n in kern.arg_names:
        if n in ("h_in", "h_out"):
            sig[n] = f"tensordesc<{state}[{box[0]}, {box[1]}],{layout!r}>"
        elif n in consts:
            sig[n] = "constexpr"
        elif n in ("A_log", "dt_bias", "g_gamma"):
            sig[n] = "*fp32"
        elif n == "slots":
            sig[n] = "*i32"
        elif n in ("q", "k", "v", "o", "beta", "g", "gk"):
            sig[n] = "*bf16"
        else:
            sig[n] = "fp32" if n in ("scale", "lower_bound") else "i32"
    print(json.dumps(_compile_sm90(kern, sig, consts, folder, {"num_warps": 4})))


@pytest.mark.parametrize("name", list(DECODE_VARIANTS))
def test_decode_compiles_for_sm90(name, tmp_path):
    """The streaming decode: TMA loads and stores of the state, no spills, and registers for the
    three programs an SM its plan runs on bf16 pools (scalar and per-key gates)."""
    res = _run_child(f"_child_decode({name!r}, {str(tmp_path)!r})", tmp_path, module="tests.backends.test_gluon_sm90")
    assert res["utmaldg"] > 0 and res["utmastg"] > 0, res
    assert res["LOCAL"] == 0 and res["STACK"] == 0, f"spills: {res}"
    assert res["shared_bytes"] <= 227 * 1024, res
    if name.endswith("pool"):
        assert res["REG"] * 128 * 3 <= 65536, res


def test_row_views_for_tma(monkeypatch):
    """row_stride: q, k, v split from one projection read as strided [B * T, heads * D] arrays;
    not heads apart, a batch stride that is not T rows, a misaligned base or row stride.
    in_place_views: those views, only with STRIDED_TMA and where every reader is a TMA load (not
    KDA's wide-block rewrite of unbounded gates), and not yet for the plain rule."""
    import torch

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.core.validation import build_problem

    B, T, H, HV, K, V = 2, 100, 2, 4, 64, 32
    bf = dict(dtype=torch.bfloat16)
    width = 2 * H * K + HV * V
    q, k, v = torch.randn(B, T, width, **bf).split([H * K, H * K, HV * V], -1)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
    assert [gluon_chunk.row_stride(x) for x in (q, k, v)] == [width] * 3
    assert gluon_chunk.row_stride(torch.randn(B, T, H, K, **bf)) == H * K
    assert gluon_chunk.row_stride(torch.randn(B, T, K, H, **bf).transpose(2, 3)) is None          # inner stride
    assert gluon_chunk.row_stride(torch.randn(B, H, T, K, **bf).transpose(1, 2)) is None          # heads apart
    assert gluon_chunk.row_stride(torch.randn(T, B, width, **bf).transpose(0, 1)[..., :H * K].view(B, T, H, K)) is None
    assert gluon_chunk.row_stride(torch.randn(B, T, width + 1, **bf)[..., :H * K].view(B, T, H, K)) is None  # row
    assert gluon_chunk.row_stride(torch.randn(B, T, width, **bf)[..., 1:H * K + 1].view(B, T, H, K)) is None  # base
    assert gluon_chunk.row_stride(torch.randn(B, 1, width, **bf)[..., :H * K].view(B, 1, H, K)) == width     # T = 1

    g, beta = torch.randn(B, T, HV), torch.rand(B, T, HV)
    gdn = build_problem("chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, delta=True, gva=True)
    gk = torch.randn(B, T, HV, K, **bf)
    bounded = build_problem("chunk_kda", q=q, k=k, v=v, gk=gk, beta=beta, delta=True, gva=True, gate_in_op="kda",
                            A_log=torch.zeros(HV), lower_bound=-5.0)
    unbounded = build_problem("chunk_kda", q=q, k=k, v=v, gk=gk, beta=beta, delta=True, gva=True)
    monkeypatch.setattr(gluon_chunk, "STRIDED_TMA", False)
    assert gluon_chunk.in_place_views(gdn) == ()
    monkeypatch.setattr(gluon_chunk, "STRIDED_TMA", True)
    assert gluon_chunk.in_place_views(gdn) == ("q", "k", "v")
    # V = 32 with a per-channel gate: the Triton summary (summaries_sm90), which reads q, k by pointer
    assert gluon_chunk.in_place_views(bounded) == ()
    q2, k2, v2 = torch.randn(B, T, 2 * H * K + HV * 64, **bf).split([H * K, H * K, HV * 64], -1)
    bounded64 = build_problem("chunk_kda", q=q2.view(B, T, H, K), k=k2.view(B, T, H, K), v=v2.view(B, T, HV, 64),
                              gk=gk, beta=beta, delta=True, gva=True, gate_in_op="kda", A_log=torch.zeros(HV),
                              lower_bound=-5.0)
    assert gluon_chunk.in_place_views(bounded64) == ("q", "k", "v")
    assert gluon_chunk.in_place_views(unbounded) == ()                                  # the wide-block rewrite
    simple_gla = build_problem("chunk_simple_gla", q=q2.view(B, T, H, K), k=k2.view(B, T, H, K),
                               v=v2.view(B, T, HV, 64)[:, :, :H], g=torch.randn(B, T, H), delta=False, gva=False)
    assert gluon_chunk.in_place_views(simple_gla) == ()                                 # (not run on a GPU yet)
    dense = build_problem("chunk_gated_delta_rule", q=q.contiguous(), k=k, v=v.contiguous(), g=g, beta=beta,
                          delta=True, gva=True)
    assert gluon_chunk.in_place_views(dense) == ("k",)
    monkeypatch.setattr(gluon_chunk, "GDN_SCORES_SM90", False)                         # the Triton scores: pointers
    assert gluon_chunk.in_place_views(gdn) == ()


def test_launcher_builds_descriptors(monkeypatch):
    """The host side of the Gluon scan on the CPU, up to the launch: TMA descriptors of the shapes
    and boxes the kernel expects, the row count for the output's store, and the tile plan (64
    columns at 1x32k HV64; 32 whenever chunk states are stored; 128 on two warpgroups, eight
    warps, at 4x8k HV32), on the plain kernel, the warp-specialized one, then the two-chain one;
    last the state-in-registers scan where its plan takes it (one chain a program at 1x32k HV64,
    two at 4x8k HV32, GDN and KDA)."""
    import torch

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_delta_dual_sm90, chunk_delta_regs_sm90, chunk_delta_sm90, chunk_delta_ws_sm90
    from fastla.backends.triton import chunk_delta
    from fastla.core.validation import build_problem

    launches = []
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", False)                 # (until the last part)

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, dict(kw, kernel=self.name)))

    names = chunk_delta_sm90._scan_sm90_kernel.arg_names
    gk_only = ("kd_desc", "decay", "STAGES", "WARPGROUPS", "GK", "DELTA")       # the plain kernel's own
    assert chunk_delta_ws_sm90._scan_ws_sm90_kernel.arg_names[:-1] == [n for n in names if n not in gk_only]
    monkeypatch.setattr(chunk_delta_sm90, "_scan_sm90_kernel", Recorder("plain"))
    monkeypatch.setattr(chunk_delta_ws_sm90, "_scan_ws_sm90_kernel", Recorder("specialized"))
    dual_names = chunk_delta_dual_sm90._scan_dual_sm90_kernel.arg_names
    assert dual_names == [n for n in names if n not in ("WARPGROUPS", "DELTA")] + ["CHAIN_NREG", "LOADER_NREG", "DELTA"]
    monkeypatch.setattr(chunk_delta_dual_sm90, "_scan_dual_sm90_kernel", Recorder("dual"))
    regs_names = chunk_delta_regs_sm90._scan_regs_sm90_kernel.arg_names
    monkeypatch.setattr(chunk_delta_regs_sm90, "_scan_regs_sm90_kernel", Recorder("regs"))
    monkeypatch.setattr(gluon_chunk, "SCAN_DUAL", False)                 # the plain kernel first
    B, T, H, HV, K, V = 1, 32768, 16, 64, 128, 128
    bf = dict(dtype=torch.bfloat16)

    def dense_pass(B, T, HV):
        """GDN inputs, their problem and a whole-sequence pass whose output is v's buffer."""
        q, k, v = torch.empty(B, T, H, K, **bf), torch.empty(B, T, H, K, **bf), torch.empty(B, T, HV, V, **bf)
        g, beta = torch.empty(B, T, HV), torch.empty(B, T, HV)
        p = build_problem("chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, delta=True, gva=True)
        scratch = torch.empty(B, T, HV, 64, **bf)
        sp = chunk_delta.SequencePass(q, k, v, beta, 1, scratch, scratch, g, g, g, v, None, None, None, None, None,
                                      T, -(-T // 64), g)
        return q, k, v, g, beta, p, scratch, sp
    q, k, v = torch.empty(B, T, H, K, **bf), torch.empty(B, T, H, K, **bf), torch.empty(B, T, HV, V, **bf)
    g, beta = torch.empty(B, T, HV), torch.empty(B, T, HV)
    p = build_problem("chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, delta=True, gva=True)
    scratch, o = torch.empty(B, T, HV, 64, **bf), torch.empty(B, T, HV, V, **bf)
    for states in (None, torch.empty(512, HV, K, V, **bf)):
        sp = chunk_delta.SequencePass(q, k, v, beta, 1, scratch, scratch, g, g, g, o, None, None, states, None, None,
                                      T, 512, g)
        gluon_chunk._sequence_scan(p, sp, 0, g, g, 1)
    (grid64, args64, kw64), (grid32, args32, kw32) = launches
    assert kw64["BV"] == 64 and grid64 == (HV * V // 64,)                # one wave of 128 programs (1-D)
    assert kw32["BV"] == 32 and kw32["STORE_STATES"] and grid32 == (HV * V // 32,)
    k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc, o_desc = args64[:7]
    assert kd_desc is k_desc and kw64["GK"] is False                           # GDN: no kd tiles
    assert list(k_desc.shape) == [B * T, H * K] and k_desc.block_shape == [64, 64]
    assert list(v_desc.shape) == list(o_desc.shape) == [B * T, HV * V]
    assert v_desc.block_shape == o_desc.block_shape == [64, 64]
    assert o_desc.base.data_ptr() == o.data_ptr() and v_desc.base.data_ptr() == v.data_ptr()
    assert list(p_desc.shape) == list(a_desc.shape) == [B * T, HV * 64]
    assert args64[names.index("n_rows")] == B * T and kw64["num_warps"] == 4
    assert kw64["kernel"] == kw32["kernel"] == "plain" and kw64["WARPGROUPS"] == kw32["WARPGROUPS"] == 1
    monkeypatch.setattr(gluon_chunk, "SCAN_SPECIALIZED", True)           # opt-in: the warp-specialized scan
    gluon_chunk._sequence_scan(p, sp, 0, g, g, 1)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "specialized" and kw["PREP_NREG"] == chunk_delta_ws_sm90.PREP_REGS and kw["BV"] == 32
    assert kw["num_warps"] == 4 and "STAGES" not in kw and "GK" not in kw
    assert [d.block_shape for d in args[:6]] == [args32[i].block_shape for i in (0, 1, 3, 4, 5, 6)]
    monkeypatch.setattr(gluon_chunk, "SCAN_SPECIALIZED", False)

    B, T, HV = 4, 8192, 32
    q, k, v, g, beta, p, scratch, sp = dense_pass(B, T, HV)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["BV"] == 128 and kw["WARPGROUPS"] == 2 and kw["num_warps"] == 8 and grid == (B * HV,)
    assert kw["kernel"] == "plain"
    assert args[3].block_shape == args[6].block_shape == [64, 128]                # v and o boxes

    # KDA (GK): gated keys and queries per value head, the kd tiles and decays, at most 64 columns
    qg, kg, kd = (torch.empty(B, T, HV, K, **bf) for _ in range(3))
    decay = torch.empty(B * 128, HV, K)
    sp = chunk_delta.SequencePass(qg, kg, v, beta, 1, scratch, scratch, g, g, None, v, None, None, None, None, None,
                                  T, 128, g, kd, decay)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "plain" and kw["GK"] is True and not kw["L2NORM"] and kw["BV"] == 64
    for desc, x in zip(args[:3], (kg, qg, kd)):                                 # k_desc, q_desc, kd_desc
        assert desc.base.data_ptr() == x.data_ptr() and list(desc.shape) == [B * T, HV * K]
        assert desc.block_shape == [64, 64]
    assert args[names.index("decay")] is decay and args[names.index("gcum")] is g      # gcum: the dummy

    # the shipped default: two chains per program (chunk_delta_dual_sm90.py), here KDA's 64 columns
    monkeypatch.setattr(gluon_chunk, "SCAN_DUAL", True)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "dual" and kw["GK"] is True and kw["BV"] == 64 and grid == (B * HV * 2,)
    assert kw["num_warps"] == 4 and kw["CHAIN_NREG"] == chunk_delta_dual_sm90.CHAIN_REGS and "WARPGROUPS" not in kw
    assert args[3].block_shape == args[6].block_shape == [64, 32]               # each chain's v and o tiles
    assert [d.block_shape for d in args[:3]] == [[64, 64]] * 3

    # a segment summary (SEG 1) on the two chains: 8 segments x HV programs over the V + K columns
    summary = torch.empty(8, HV, K, V + K)
    gluon_chunk._sequence_scan(p, sp, 1, g, summary, 8)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "dual" and kw["SEG"] == 1 and kw["BV"] == 64 and grid == (8 * HV * (V + K) // 64,)
    assert args[dual_names.index("seg_state")] is summary

    # the plain rule (DELTA False): GLA's kd descriptor stands in for the gated keys' (not loaded);
    # P and beta are the scores (as triton_chunk.run passes them; neither is used)
    p = build_problem("chunk_gla", q=q, k=k, v=v[:, :, :H], gk=torch.empty(B, T, H, K, **bf), delta=False, gva=False)
    scores = scratch[:, :, :H]
    sp = chunk_delta.SequencePass(qg[:, :, :H], decay, v[:, :, :H], scores, 1, scores, scores, None, None,
                                  None, v[:, :, :H], None, None, None, None, None, T, 128, decay,
                                  kd[:, :, :H].contiguous(), decay)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["DELTA"] is False and kw["GK"] is True
    k_desc, q_desc, kd_desc, v_desc, p_desc, a_desc = args[:6]
    assert k_desc is kd_desc and kd_desc.base is sp.kd and p_desc.base is a_desc.base is sp.scores
    assert args[dual_names.index("beta")] is sp.scores

    # the state in registers (chunk_delta_regs_sm90.py), where regs_chains plans it: KDA at 4x8k
    # H32 (two chains, 128 programs), GDN at 4x8k HV32 (two) and 1x32k HV64 (one chain, 128 programs)
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", True)
    p = build_problem("chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=beta, delta=True, gva=True)
    sp = chunk_delta.SequencePass(qg, kg, v, beta, 1, scratch, scratch, g, g, None, v, None, None, None, None, None,
                                  T, 128, g, kd, decay)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "regs" and kw["GK"] is True and kw["CHAINS"] == 2 and grid == (B * HV,)
    assert [d.base for d in args[:3]] == [kg, qg, kd] and args[regs_names.index("decay")] is decay
    assert all(d.block_shape == [64, 64] for d in args[:7]) and kw["num_warps"] == 4
    sp = chunk_delta.SequencePass(q, k, v, beta, 1, scratch, scratch, g, g, g, v, None, None, None, None, None,
                                  T, 128, g)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "regs" and kw["GK"] is False and kw["CHAINS"] == 2 and args[2] is args[0]
    B, T, HV = 1, 32768, 64
    q, k, v, g, beta, p, scratch, sp = dense_pass(B, T, HV)
    gluon_chunk._sequence_scan(p, sp, 0, g, g, B)
    grid, args, kw = launches[-1]
    assert kw["kernel"] == "regs" and kw["CHAINS"] == 1 and grid == (HV * V // 64,)
    assert args[regs_names.index("n_rows")] == B * T and kw["L2NORM"] is p.use_qk_l2norm
    assert kw["QK"] is False and args[5].base is scratch                   # the scores kernel's tiles
    import dataclasses                                                     # the scores formed in the scan:
    gluon_chunk._sequence_scan(p, dataclasses.replace(sp, scores=None), 0, g, g, B)   # the keys' descriptor
    grid, args, kw = launches[-1]                                          # stands in for the scores'
    assert kw["kernel"] == "regs" and kw["CHAINS"] == 1 and kw["QK"] is True and args[5] is args[0]


def test_plan_on_sm90():
    """The sm_90 tier's plan: its split gain (1x8k HV16 splits, unlike the Triton tier's plan) and
    the segment combine at 8 warps, two stages, 16 value columns (the portable default: 4, 1, 32)."""
    import torch

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.triton import chunk_delta
    from fastla.core.validation import build_problem

    B, T, H, HV, K, V = 1, 8192, 4, 16, 128, 128
    q, k = torch.empty(B, T, H, K, dtype=torch.bfloat16), torch.empty(B, T, H, K, dtype=torch.bfloat16)
    v, g = torch.empty(B, T, HV, V, dtype=torch.bfloat16), torch.empty(B, T, HV)
    p = build_problem("chunk_gated_delta_rule", q=q, k=k, v=v, g=g, beta=g, delta=True, gva=True)
    base, sm90 = chunk_delta.default_config(p), gluon_chunk.plan(p)
    assert base.segment_chunks == 0 and sm90.segment_chunks == 16
    assert (base.combine_warps, base.combine_stages) == (4, 1)
    assert (sm90.combine_warps, sm90.combine_stages) == (gluon_chunk.COMBINE_WARPS, gluon_chunk.COMBINE_STAGES) == (8, 2)
    assert (base.combine_block_v, sm90.combine_block_v) == (32, gluon_chunk.COMBINE_BLOCK_V) == (32, 16)


def test_scan_tile_plan():
    """The tile plan (waves of one-program-per-SM tiles x step time) on the measured shapes."""
    from fastla.backends.gluon.chunk_delta import scan_tile
    assert scan_tile(64, 128, 132) == (64, 1)              # 1x32k HV64: 128 lanes of 64 columns, one wave
    assert scan_tile(128, 128, 132) == (128, 2)            # 4x8k HV32: one wave of 128-column programs
    assert scan_tile(16, 128, 132) == (32, 1)              # 1x8k HV16: 32-column programs fit one wave
    assert scan_tile(32, 128, 132) == (32, 1)              # 1x32k HV32
    assert scan_tile(64, 96, 132) == (32, 1)               # only 32 divides V = 96
    assert scan_tile(64, 64, 132) == (32, 1) and scan_tile(132, 64, 132) == (64, 1)     # K = V = 64


def test_regs_chains_plan(monkeypatch):
    """Where the state-in-registers scan runs (chunk_delta.regs_chains), on the H100-measured
    shapes: one chain when its 64-column programs fill half a wave to one, two beyond one wave,
    the two-chain scan for fewer lanes, segment replays, chunk states and summaries."""
    from types import SimpleNamespace

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    p = SimpleNamespace(delta=True, V=128)
    plan = gluon_chunk.regs_chains
    assert plan(p, 0, False, 64, 132) == 1                 # 1x32k HV64: 128 programs, one wave
    assert plan(p, 0, False, 128, 132) == 2                # 4x8k HV32: two chains, one wave of 128
    assert plan(p, 0, False, 16, 132) == 0                 # 1x8k HV16: the two-chain scan's 32 columns
    assert plan(p, 2, False, 64, 132) == 0 and plan(p, 1, False, 64, 132) == 0     # replays, summaries
    assert plan(p, 0, True, 64, 132) == 0                  # chunk states stored
    assert plan(SimpleNamespace(delta=False, V=128), 0, False, 64, 132) == 0      # the plain rule
    assert plan(SimpleNamespace(delta=True, V=64), 0, False, 300, 132) == 1       # two chains need V % 128
    assert plan(SimpleNamespace(delta=True, V=96), 0, False, 64, 132) == 0
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 2)     # forced (tests, sweeps): wherever it serves
    assert plan(p, 2, False, 4, 132) == 2 and plan(SimpleNamespace(delta=True, V=64), 0, False, 4, 132) == 1
    monkeypatch.setattr(gluon_chunk, "SCAN_REGS", False)
    assert plan(p, 0, False, 64, 132) == 0


def test_pipeline_plan_and_pieces(monkeypatch):
    """GDN's pipeline (chunk_delta.pipeline_pieces, _run_pipelined) on the CPU, kernels recorded:
    the plan takes one sequence (or offsets [0, T] on the host) whose one-chain programs fill at most half the SMs, up to four
    pieces of at least 64 chunks (two at 8k tokens, four at 32k), none where segments are planned, for a batch, offsets, GVA
    beyond half a wave, a missing gate or beta, or chunk states. Each piece launches its inverse,
    scores and a one-chain scan of its rows, from the previous piece's final state (fp32), the
    last into the call's final state."""
    import torch

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_inverse_sm90, chunk_scores_sm90
    from fastla.core.validation import build_problem

    def problem(B=1, T=4096 + 30, H=16, HV=32, g=True, beta=True, **opts):
        bf = dict(dtype=torch.bfloat16)
        return build_problem("chunk_gated_delta_rule", q=torch.empty(B, T, H, 128, **bf),
                             k=torch.empty(B, T, H, 128, **bf), v=torch.empty(B, T, HV, 128, **bf),
                             g=torch.empty(B, T, HV) if g else None, beta=torch.empty(B, T, HV) if beta else None,
                             delta=True, gva=True, **opts)

    def pieces(p):
        return gluon_chunk.pipeline_pieces(p, gluon_chunk.plan(p))

    assert pieces(problem(T=32768)) == 4 and pieces(problem(T=8192)) == 2     # h16-hv32: 64 programs
    assert pieces(problem()) == 1                                       # 65 chunks
    assert pieces(problem(HV=64)) == 1                                  # 128 programs: no idle SMs
    assert pieces(problem(B=2, T=8192)) == 1 and pieces(problem(T=8192, g=False)) == 1
    assert pieces(problem(T=8192, beta=False)) == 1 and pieces(problem(T=8192, return_intermediate_states=True)) == 1
    assert pieces(problem(H=2, HV=8, T=32768)) == 1                     # segments planned
    cu = torch.tensor([0, 2000, 8192])
    assert pieces(problem(T=8192, cu_seqlens=cu, cu_seqlens_cpu=cu)) == 1
    one = torch.tensor([0, 8192])                                       # a packed batch of one sequence
    assert pieces(problem(T=8192, cu_seqlens=one, cu_seqlens_cpu=one)) == 2
    monkeypatch.setattr(gluon_chunk, "PIPELINE_PIECES", 3)
    assert pieces(problem(T=1024)) == 3 and pieces(problem(HV=64)) == 1

    calls = []
    monkeypatch.setattr(chunk_inverse_sm90, "launch", lambda p, *a: calls.append(("inverse", p.T)))
    monkeypatch.setattr(chunk_scores_sm90, "launch", lambda p, *a: calls.append(("scores", p.T)))

    def scan(p, sp, seg, segments, seg_state, programs, chains):
        calls.append(("scan", p.T, chains, seg, sp.o.data_ptr(), sp.h0, sp.ht))

    monkeypatch.setattr(gluon_chunk, "_regs_scan", scan)
    p = problem(initial_state=torch.zeros(1, 32, 128, 128), output_final_state=True)
    o, ht = gluon_chunk._run_pipelined(p, gluon_chunk.plan(p), 3)
    rows = [21 * 64, 22 * 64, 4126 - 43 * 64]                           # 65 chunks in three pieces
    assert [c[:2] for c in calls] == [(kind, n) for n in rows for kind in ("inverse", "scores", "scan")]
    scans = [c for c in calls if c[0] == "scan"]
    row_bytes = 32 * 128 * 2
    assert [c[4] - o.data_ptr() for c in scans] == [0, rows[0] * row_bytes, (rows[0] + rows[1]) * row_bytes]
    assert all(c[2] == 1 and c[3] == 0 for c in scans)                  # one chain, whole (sub)sequences
    assert scans[0][5] is p.initial_state
    assert scans[1][5] is scans[0][6] and scans[2][5] is scans[1][6] and scans[2][6] is ht
    assert ht.dtype == torch.float32 and o.shape == (1, 4126, 32, 128)


def test_scores_in_scan_plan_and_launches(monkeypatch):
    """GDN's scores formed in the scan (chunk_delta.SCORES_IN_SCAN, scores_in_scan): planned where
    every pass runs the state-in-registers scan (1x32k HV64: one chain; 4x8k HV32: two), not for
    a pipeline's pieces, segments, chunk states or the flag off; such a call launches the inverse
    with the norms' buffers (``rq``, ``rk``, l2norm in the op) writing P diag(beta) (BETA_IN_P), no
    scores kernel, and a scan pass whose scores are None and whose P carries beta."""
    import torch

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_inverse_sm90, chunk_scores_sm90
    from fastla.core.validation import build_problem

    def problem(B=1, T=32768, H=16, HV=64, **opts):
        bf = dict(dtype=torch.bfloat16)
        return build_problem("chunk_gated_delta_rule", q=torch.empty(B, T, H, 128, **bf),
                             k=torch.empty(B, T, H, 128, **bf), v=torch.empty(B, T, HV, 128, **bf),
                             g=torch.empty(B, T, HV), beta=torch.empty(B, T, HV), delta=True, gva=True, **opts)

    def planned(p):
        config = gluon_chunk.plan(p)
        return gluon_chunk.scores_in_scan(p, config, gluon_chunk.pipeline_pieces(p, config))

    monkeypatch.setattr(gluon_chunk, "SCORES_IN_SCAN", False)
    assert not planned(problem())                                            # the flag is off
    monkeypatch.setattr(gluon_chunk, "SCORES_IN_SCAN", True)
    assert planned(problem()) and planned(problem(B=4, T=8192, HV=32))       # one chain; two
    assert not planned(problem(return_intermediate_states=True))
    assert not planned(problem(scale=-0.1)) and planned(problem(scale=0.1))  # (log2 of the scale)
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 1)                       # (the scan serves these
    assert not planned(problem(HV=32, T=8192))                               # shapes): pipelined,
    assert not planned(problem(H=2, HV=8))                                   # segments planned
    monkeypatch.setattr(gluon_chunk, "PIPELINE", False)
    assert planned(problem(HV=32, T=8192))

    calls = []
    monkeypatch.setattr(chunk_inverse_sm90, "launch",
                        lambda p, *a, **kw: calls.append(("inverse", sorted(kw), kw.get("beta_cols"))))
    monkeypatch.setattr(chunk_scores_sm90, "launch", lambda p, *a, **kw: calls.append(("scores",)))

    def scan(p, sp, seg, segments, seg_state, programs, chains):
        calls.append(("scan", sp.scores, chains, sp.beta_in_p))

    monkeypatch.setattr(gluon_chunk, "_regs_scan", scan)
    gluon_chunk.run(problem(T=4096, use_qk_l2norm=True))
    assert calls == [("inverse", ["beta_cols", "rk", "rq"], True), ("scan", None, 1, True)], calls
    calls.clear()
    monkeypatch.setattr(gluon_chunk, "BETA_IN_P", False)
    gluon_chunk.run(problem(T=4096, use_qk_l2norm=True))
    assert calls == [("inverse", ["beta_cols", "rk", "rq"], False), ("scan", None, 1, False)], calls


def test_gates_in_scan_plan_and_launches(monkeypatch):
    """KDA's gated keys and queries formed in the scan (chunk_delta.GATES_IN_SCAN, gates_in_scan):
    planned for the bounded gate where the call is one pass of the one-chain state-in-registers
    scan (1x8k and 1x16k H64) or takes two chains where one chain's programs fill their last wave
    (2x16k H64), not where they would not (1x8k H96), with the flag off, an unbounded gate, chunk states,
    segments or an fp32 gate; such a call launches the prologue without kg, kd nor qg and a
    one-chain scan pass that reads the raw q, k and the gate's input, the prologue writing the rows'
    norms."""
    import torch

    from fastla.backends.gluon import chunk_delta as gluon_chunk
    from fastla.backends.gluon import chunk_prepare_kda_sm90
    from fastla.core.validation import build_problem

    def problem(B=1, T=8192, H=64, gate=torch.bfloat16, lower_bound=-5.0, **opts):
        bf = dict(dtype=torch.bfloat16)
        return build_problem("chunk_kda", q=torch.empty(B, T, H, 128, **bf), k=torch.empty(B, T, H, 128, **bf),
                             v=torch.empty(B, T, H, 128, **bf), gk=torch.empty(B, T, H, 128, dtype=gate),
                             beta=torch.empty(B, T, H, **bf), delta=True, gva=True, gate_in_op="kda",
                             A_log=torch.zeros(H), dt_bias=torch.zeros(H * 128), lower_bound=lower_bound,
                             use_qk_l2norm=True, **opts)

    def planned(p):
        return gluon_chunk.gates_in_scan(p, gluon_chunk.plan(p))

    monkeypatch.setattr(gluon_chunk, "GATES_IN_SCAN", False)
    assert not planned(problem())
    monkeypatch.setattr(gluon_chunk, "GATES_IN_SCAN", True)
    assert planned(problem()) and planned(problem(T=16384))
    assert planned(problem(B=2, T=16384))                                  # two planned, one fills 0.97
    assert not planned(problem(H=96))                                       # two planned, one fills 0.73
    monkeypatch.setattr(gluon_chunk, "GATES_WAVE_FILL", 1.0)
    assert not planned(problem(B=2, T=16384))
    monkeypatch.setattr(gluon_chunk, "GATES_WAVE_FILL", 0.9)
    assert not planned(problem(lower_bound=None)) and not planned(problem(gate=torch.float32))
    assert not planned(problem(return_intermediate_states=True))
    assert not planned(problem(H=4))                                        # few lanes: other scans

    calls = []
    monkeypatch.setattr(chunk_prepare_kda_sm90, "launch",
                        lambda p, beta, mode, total, tables, inverse, scores, kg, kd, qg, decay, rq, rk, beta_cols:
                        calls.append(("prologue", kg, kd, qg, rq.shape, rk.shape, beta_cols)))

    def scan(p, sp, seg, segments, seg_state, programs, chains):
        calls.append(("scan", sp.gates, chains, sp.q is p.q, sp.k is p.k, sp.kd is p.gk, sp.beta_in_p))

    monkeypatch.setattr(gluon_chunk, "_regs_scan", scan)
    gluon_chunk.run(problem(T=16384))
    rows = (1, 16384, 64)                                                   # the norms (l2norm in the op)
    want = [("prologue", None, None, None, rows, rows, True), ("scan", True, 1, True, True, True, True)]
    assert calls == want, calls
    calls.clear()
    gluon_chunk.run(problem(B=2, T=16384))                                  # two chains planned: one launched
    rows = (2, 16384, 64)
    want = [("prologue", None, None, None, rows, rows, True), ("scan", True, 1, True, True, True, True)]
    assert calls == want, calls
    calls.clear()
    with monkeypatch.context() as m:                                        # P without beta (A/B)
        m.setattr(gluon_chunk, "BETA_IN_P", False)
        gluon_chunk.run(problem(B=2, T=16384))
    assert [c[-1] for c in calls] == [False, False], calls
    monkeypatch.setattr(gluon_chunk, "REGS_CHAINS", 2)                      # forced two: the prologue's tiles
    assert not planned(problem(B=2, T=16384)) and not planned(problem())


@pytest.mark.parametrize("kernel", ["dual", "plain", "ws"])
def test_scan_profile_markers_match_the_kernels(kernel):
    """benchmarks/gdn_scan_profile.py instruments a copy of each Gluon scan at marker lines: every
    marker must still occur exactly once (it stops otherwise, on the GPU machine's time)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gdn_scan_profile.py"
    spec = importlib.util.spec_from_file_location("gdn_scan_profile", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    target = tool.TARGETS[kernel]
    src = tool._instrument((tool.GLUON / target["file"]).read_text(), target)
    assert src.count("_clock(r)") == len(target["phases"]) and "prof=None" in src
    compile(src, target["file"], "exec")                # the reads' indentation (a marker on a continuation line)


KDA_PROLOGUE_VARIANTS = {
    # name: constexprs over the registry's launch (K = 128, GVA 2:1, gate with A_log and dt_bias, l2norm)
    # with FROM_X and FULL off; what ships sets both (dense, T a multiple of 64: kda-prologue-from-x-full)
    # or FROM_X (varlen)
    "kda-prologue": {},
    "kda-prologue-varlen-bare": dict(VARLEN=True, L2NORM=False, HAS_A=False, HAS_BIAS=False,
                                     BETA=1),
    "kda-prologue-k64": dict(K=64),
    "kda-prologue-varlen-k64": dict(VARLEN=True, K=64),
    # the bounded gate's left operands from X (chunk_prepare_kda_sm90.BOUNDED_OPERANDS)
    "kda-prologue-from-x": dict(FROM_X=True),
    "kda-prologue-from-x-varlen-k64": dict(FROM_X=True, VARLEN=True, K=64),
    # whole chunks without row masks (chunk_prepare_kda_sm90.FULL_CHUNKS), with each form of operands
    "kda-prologue-full": dict(FULL=True),
    "kda-prologue-from-x-full": dict(FROM_X=True, FULL=True),
    # the gated keys and queries formed in the scan (gluon/chunk_delta.gates_in_scan): not stored here
    "kda-prologue-from-x-full-ungated": dict(FROM_X=True, FULL=True, GATED=False),
    "kda-prologue-from-x-varlen-ungated": dict(FROM_X=True, VARLEN=True, GATED=False),
    # A's scratch in fp16 (chunk_prepare_kda_sm90.A_FP16: a decaying gate, l2norm, beta by sigmoid, the
    # gated tiles stored)
    "kda-prologue-from-x-full-a16": dict(FROM_X=True, FULL=True, A_FP16=True),
    "kda-prologue-from-x-varlen-a16": dict(FROM_X=True, VARLEN=True, A_FP16=True),
    # the bias and beta loaded where they are used (chunk_prepare_kda_sm90.LOADS_AHEAD off)
    "kda-prologue-from-x-full-ungated-loads-late": dict(FROM_X=True, FULL=True, GATED=False, AHEAD=False),
    # unbounded gates with the block flags: given (bf16 and fp32) and softplus
    "kda-prologue-given-gate": dict(GATE=0, HAS_A=False, HAS_BIAS=False, FLAG=True),
    "kda-prologue-given-fp32-gate": dict(GATE=0, HAS_A=False, HAS_BIAS=False, FLAG=True, GATE_FP32=True),
    "kda-prologue-softplus-gate": dict(GATE=2, FLAG=True),
    "kda-prologue-softplus-gate-a16": dict(GATE=2, FLAG=True, A_FP16=True),
    "kda-prologue-wide-bounded-neg-eigval": dict(FLAG=True, BETA=3),
    # GLA (the plain rule, DELTA False): its given gate, no l2norm, no A nor kg
    "gla-prologue": dict(GATE=0, HAS_A=False, HAS_BIAS=False, FLAG=True, L2NORM=False, BETA=1, DELTA=False, H=64),
}
# Spills known and left (sm_90 compile): every build sits at 255 registers; the persistent loop (the
# next item's coordinates live across the slices) spills 24 bytes on the build without FROM_X and FULL,
# 24-48 with the block flags, 48 at K = 64 and 152 with an fp32 gate; the bare varlen build 8; the bounded
# gate's operands from X none at K = 128, 16 at K = 64 (8 before LOADS_AHEAD: the next slice's bias)
KDA_PROLOGUE_STACK = {"kda-prologue": 24, "kda-prologue-varlen-bare": 8, "kda-prologue-k64": 48,
                      "kda-prologue-varlen-k64": 48, "kda-prologue-from-x-varlen-k64": 16,
                      "kda-prologue-given-gate": 24, "kda-prologue-given-fp32-gate": 152,
                      "kda-prologue-softplus-gate": 48, "kda-prologue-softplus-gate-a16": 48,
                      "kda-prologue-wide-bounded-neg-eigval": 48}


def _child_kda_prologue(name: str, folder: str) -> None:
    from triton.experimental.gluon import language as gl

    from fastla.backends.gluon.chunk_prepare_kda_sm90 import MAXNREG
    from fastla.backends.gluon.chunk_prepare_kda_sm90 import _kda_prologue_sm90_kernel as kern

    consts = dict(H=32, HV=64, K=128, L2NORM=True, GATE=3, HAS_A=True, HAS_BIAS=True, BETA=2, VARLEN=False,
                  FLAG=False, DELTA=True, FROM_X=False, FULL=False, GATED=True)
    consts.update(KDA_PROLOGUE_VARIANTS[name])
    consts.setdefault("AHEAD", consts["FROM_X"])                            # as launch() (LOADS_AHEAD)
    gate_fp32 = consts.pop("GATE_FP32", False)
    a_fp16 = consts.pop("A_FP16", False)
    consts["QK_BUFFERS"] = 1 if gate_fp32 else 2                           # as launch()
    box = gl.NVMMASharedLayout.get_default_for([64, 32], gl.bfloat16)
    gate_box = gl.NVMMASharedLayout.get_default_for([64, 32], gl.float32) if gate_fp32 else box
    pointers = {"beta": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "a_kk": "*fp16" if a_fp16 else "*fp32",
                "a_qk": "*bf16",
                "kg": "*bf16", "kd": "*bf16", "qg": "*bf16", "decay": "*fp32", "flags": "*i32",
                "rq_out": "*fp32", "rk_out": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32"}
    names = kern.arg_names
    sig = {}
    for n in names:
        if n == "g_desc" and gate_fp32:
            sig[n] = f"tensordesc<fp32[64, 32],{gate_box!r}>"
        elif n.endswith("_desc"):
            sig[n] = f"tensordesc<bf16[64, 32],{box!r}>"
        else:
            sig[n] = pointers.get(n) or ("constexpr" if n in consts else ("i32" if n in ("T", "NT", "total") else "fp32"))
    options = {"num_warps": 4, **({"maxnreg": MAXNREG} if MAXNREG and consts["K"] == 128 else {})}   # as launch()
    print(json.dumps(_compile_sm90(kern, sig, consts, folder, options)))


@pytest.mark.parametrize("name", list(KDA_PROLOGUE_VARIANTS))
def test_kda_prologue_compiles_for_sm90(name, tmp_path):
    res = _run_child(f"_child_kda_prologue({name!r}, {str(tmp_path)!r})", tmp_path,
                     module="tests.backends.test_gluon_sm90")
    assert res["hgmma"] > 0 and res["utmaldg"] > 0, res                   # wgmma products, TMA loads
    assert res["LOCAL"] == 0 and res["STACK"] <= KDA_PROLOGUE_STACK.get(name, 0), f"spills: {res}"
    assert res["shared_bytes"] <= 227 * 1024 // 2, res                    # two programs per SM


GDN_SCORES_VARIANTS = {
    # name: constexprs over the default launch (K = 128, GVA 4:1, l2norm)
    "gdn-scores": {},
    "gdn-scores-varlen-k64-raw": dict(VARLEN=True, L2NORM=False, K=64),
}


def _child_gdn_scores(name: str, folder: str) -> None:
    from triton.experimental.gluon import language as gl

    from fastla.backends.gluon.chunk_scores_sm90 import _gdn_scores_sm90_kernel as kern

    consts = dict(H=16, HV=64, K=128, L2NORM=True, VARLEN=False)
    consts.update(GDN_SCORES_VARIANTS[name])
    box = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    pointers = {"gcum": "*fp32", "s_out": "*bf16", "rq_out": "*fp32", "rk_out": "*fp32", "cu_seqlens": "*i64",
                "chunk_index": "*i32"}
    sig = {n: (f"tensordesc<bf16[64, 64],{box!r}>" if n.endswith("_desc") else pointers.get(n)
               or ("constexpr" if n in consts else ("i32" if n in ("T", "NT") else "fp32")))
           for n in kern.arg_names}
    print(json.dumps(_compile_sm90(kern, sig, consts, folder, {"num_warps": 4})))


@pytest.mark.parametrize("name", list(GDN_SCORES_VARIANTS))
def test_gdn_scores_compiles_for_sm90(name, tmp_path):
    res = _run_child(f"_child_gdn_scores({name!r}, {str(tmp_path)!r})", tmp_path,
                     module="tests.backends.test_gluon_sm90")
    assert res["hgmma"] > 0 and res["utmaldg"] > 0, res                   # wgmma products, TMA loads
    assert res["LOCAL"] == 0 and res["STACK"] == 0, f"spills: {res}"
    assert res["REG"] <= 128 and res["shared_bytes"] <= 227 * 1024 // 4, res   # four programs per SM


GDN_INVERSE_VARIANTS = {
    # name: constexprs over the default launch (K = 128, GVA 4:1, four value heads a program, gate in
    # the op, l2norm, beta sigmoid)
    "gdn-inverse": {},
    "gdn-inverse-one-head": dict(VPP=1),
    "gdn-inverse-varlen-k64-raw": dict(VARLEN=True, L2NORM=False, K=64, GATE=False, HAS_BIAS=False, BETA=1),
    "gdn-inverse-exp2": dict(EXP2=True),        # A's exponentials on ex2.approx.ftz (INVERSE_EXP2)
    "gdn-inverse-direct": dict(DIRECT=True),    # the merges' operands converted once (INVERSE_DIRECT_OPERANDS)
    "gdn-inverse-exp2-direct": dict(EXP2=True, DIRECT=True),
    "gdn-inverse-direct-varlen-k64": dict(DIRECT=True, VARLEN=True, K=64),    # (its own scratch buffers)
    # 1 / |q|, 1 / |k| too, and P diag(beta) (the scores formed in the scan)
    "gdn-inverse-norms": dict(NORMS=True, BETA_COLS=True),
    "gdn-inverse-norms-varlen-k64": dict(NORMS=True, VARLEN=True, K=64, BETA_COLS=True),
}
# stack as launched (aligned pointers): at four value heads a program the ten Gram blocks (80
# registers) live across the heads; the shipped build (gdn-inverse, 104 bytes) measured 8-12% faster
# than the Triton kernel on the H200 (docs/notes/gdn-prefill.md v18); P diag(beta) 40 bytes more
# (nine more spill stores and reloads a head, of ~2400 instructions)
GDN_INVERSE_STACK = {"gdn-inverse": 104, "gdn-inverse-one-head": 8, "gdn-inverse-varlen-k64-raw": 56,
                     "gdn-inverse-exp2": 88, "gdn-inverse-direct": 48, "gdn-inverse-exp2-direct": 48,
                     "gdn-inverse-direct-varlen-k64": 48, "gdn-inverse-norms": 144, "gdn-inverse-norms-varlen-k64": 144}


def _child_gdn_inverse(name: str, folder: str) -> None:
    from triton.experimental.gluon import language as gl

    from fastla.backends.gluon.chunk_inverse_sm90 import _gdn_inverse_sm90_kernel as kern

    consts = dict(H=16, HV=64, K=128, VPP=4, L2NORM=True, GATE=True, HAS_BIAS=True, BETA=2, VARLEN=False,
                  EXP2=False, DIRECT=False, NORMS=False, BETA_COLS=False)
    consts.update(GDN_INVERSE_VARIANTS[name])
    box = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    pointers = {"g": "*fp32", "beta": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "p_out": "*bf16",
                "gcum": "*fp32", "cu_seqlens": "*i64", "chunk_index": "*i32", "rq_out": "*fp32", "rk_out": "*fp32"}
    sig = {n: (f"tensordesc<bf16[64, 64],{box!r}>" if n.endswith("_desc") else pointers.get(n)
               or ("constexpr" if n in consts else ("i32" if n in ("T", "NT") else "fp32")))
           for n in kern.arg_names}
    res = _compile_sm90(kern, sig, consts, folder, {"num_warps": 1})
    print(json.dumps(res))


@pytest.mark.parametrize("name", list(GDN_INVERSE_VARIANTS))
def test_gdn_inverse_compiles_for_sm90(name, tmp_path):
    res = _run_child(f"_child_gdn_inverse({name!r}, {str(tmp_path)!r})", tmp_path,
                     module="tests.backends.test_gluon_sm90")
    assert res["hmma"] > 0 and res["utmaldg"] > 0, res                    # mma.sync products, TMA loads
    assert res["LOCAL"] == 0 and res["STACK"] <= GDN_INVERSE_STACK.get(name, 0), f"spills: {res}"
    # twelve one-warp programs per SM by shared memory (the scratch on the keys' tiles); at four heads a
    # program the registers hold it to eight
    assert res["shared_bytes"] <= 227 * 1024 // 12, res


# (P diag(beta) where the scan forms the gated keys: gluon/chunk_delta.BETA_IN_P)
KDA_INVERSE_VARIANTS = {"kda-inverse": {}, "kda-inverse-varlen": dict(VARLEN=True),
                        "kda-inverse-beta-cols": dict(BETA_COLS=True),
                        # A in fp16 (chunk_prepare_kda_sm90.A_FP16), P diag(beta) as the registry's calls
                        "kda-inverse-a16-beta-cols": dict(BETA_COLS=True, A_FP16=True)}


def _child_kda_inverse(name: str, folder: str) -> None:
    from fastla.backends.gluon.chunk_inverse_sm90 import _kda_inverse_sm90_kernel as kern

    consts = {"HV": 64, "VARLEN": False, "BETA": 2, "BETA_COLS": False, **KDA_INVERSE_VARIANTS[name]}
    a_fp16 = consts.pop("A_FP16", False)
    pointers = {"a": "*fp16" if a_fp16 else "*fp32", "p_out": "*bf16", "beta": "*bf16", "cu_seqlens": "*i64",
                "chunk_index": "*i32"}
    sig = {n: pointers.get(n) or ("constexpr" if n in consts else "i32") for n in kern.arg_names}
    res = _compile_sm90(kern, sig, consts, folder, {"num_warps": 1})
    print(json.dumps(res))


@pytest.mark.parametrize("name", list(KDA_INVERSE_VARIANTS))
def test_kda_inverse_compiles_for_sm90(name, tmp_path):
    """KDA's inverse kernel in Gluon: tf32 mma.sync merges, no spill, a one-warp program's 16 KB of
    shared memory (twelve programs an SM at least, as the Triton kernel), P stored in 16-byte runs
    (64 rows x 128 bytes over 32 lanes: 16 stores a lane)."""
    res = _run_child(f"_child_kda_inverse({name!r}, {str(tmp_path)!r})", tmp_path,
                     module="tests.backends.test_gluon_sm90")
    assert res["hmma"] > 0 and res["stg128"] == 16, res
    assert res["LOCAL"] == 0 and res["STACK"] == 0, f"spills: {res}"
    assert res["shared_bytes"] <= 227 * 1024 // 12, res


def test_kda_prologue_launch_builds_descriptors(monkeypatch):
    """The host side of the sm_90 KDA prologue on the CPU, up to its launches: q, k ([B T, H K])
    and the gate ([B T, HV K]) in [64, 32] TMA boxes, the grid, the register cap, no block flags for
    the bounded gate, and the inverse over the same chunks; with an unbounded gate, the flags and
    the wide-block kernel between the prologue and the inverse."""
    import torch

    from fastla.backends.gluon import chunk_inverse_sm90
    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    from fastla.backends.triton import chunk_prepare_kda_wide, launch, sm_count
    from fastla.core.validation import build_problem

    launches, inverses = [], []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))

    monkeypatch.setattr(launch, "launcher", lambda fn, T=None, NT=None: Recorder())
    assert sm90.INVERSE_SM90                                                # (the Gluon inverse, shipped)
    monkeypatch.setattr(chunk_inverse_sm90, "launch_kda", lambda *args: inverses.append(args))
    B, T, H, HV, K = 2, 200, 2, 4, 128
    bf = dict(dtype=torch.bfloat16)
    q, k = torch.randn(B, T, H, K, **bf), torch.randn(B, T, H, K, **bf)
    v, g = torch.randn(B, T, HV, K, **bf), torch.randn(B, T, HV, K, **bf)
    p = build_problem("chunk_kda", q=q, k=k, v=v, gk=g, beta=torch.rand(B, T, HV, **bf), delta=True, gva=True,
                      gate_in_op="kda", A_log=torch.zeros(HV), lower_bound=-5.0)
    total = B * 4
    out = [torch.empty(B, T, HV, 64, **bf), torch.empty(B, T, HV, 64, **bf)] + [torch.empty(B, T, HV, K, **bf)] * 3
    sm90.launch(p, p.beta, 2, total, (None, None), *out, torch.empty(total, HV, K))
    ((grid, args, kw),) = launches
    names = sm90._kda_prologue_sm90_kernel.arg_names
    assert grid == (min(total * HV, sm90.PROGRAMS_PER_SM * sm_count(torch.device("cpu"))),)   # persistent
    assert args[names.index("total")] == total and kw["QK_BUFFERS"] == 2 and kw["num_warps"] == 4 and kw.get("maxnreg") == sm90.MAXNREG
    assert kw["GATE"] == 3 and kw["FLAG"] is False
    q_desc, k_desc, g_desc = args[:3]
    assert list(q_desc.shape) == list(k_desc.shape) == [B * T, H * K]
    assert list(g_desc.shape) == [B * T, HV * K]
    assert q_desc.block_shape == k_desc.block_shape == g_desc.block_shape == [64, 32]
    assert q_desc.base.data_ptr() == q.data_ptr() and g_desc.base.data_ptr() == g.data_ptr()
    assert args[names.index("a_qk")] is out[1] and args[names.index("kg")] is out[2]
    ((_, n_chunks, _, a_kk, inverse),) = inverses
    assert n_chunks == total and inverse is out[0] and a_kk is args[names.index("a_kk")]
    assert a_kk.dtype == torch.float32                                      # raw keys: |A| unbounded
    # A's scratch in fp16 (A_FP16) with the l2norm in the op and beta by sigmoid; raw beta keeps fp32
    assert sm90.A_FP16
    p_unit = build_problem("chunk_kda", q=q, k=k, v=v, gk=g, beta=p.beta, delta=True, gva=True, gate_in_op="kda",
                           A_log=torch.zeros(HV), lower_bound=-5.0, use_qk_l2norm=True)
    for beta_mode, dtype in ((2, torch.float16), (3, torch.float16), (1, torch.float32)):
        launches.clear()
        sm90.launch(p_unit, p.beta, beta_mode, total, (None, None), *out, torch.empty(total, HV, K))
        ((_, args, _),) = launches
        assert args[names.index("a_kk")].dtype == dtype and inverses[-1][3] is args[names.index("a_kk")]
    # under the gaters' scan (no gated tiles stored) fp32: fp16 measured slower there
    launches.clear()
    sm90.launch(p_unit, p.beta, 2, total, (None, None), out[0], out[1], None, None, None, torch.empty(total, HV, K),
                torch.empty(B, T, H), torch.empty(B, T, H))
    ((_, args, kw),) = launches
    assert kw["GATED"] is False and args[names.index("a_kk")].dtype == torch.float32
    # an unbounded gate: block flags, then the wide-block kernel on the same scratch, then the inverse
    order = []
    monkeypatch.setattr(chunk_prepare_kda_wide, "launch", lambda *args: order.append(("wide", args)))
    monkeypatch.setattr(chunk_inverse_sm90, "launch_kda", lambda *args: order.append(("inverse", args)))
    launches.clear()
    p = build_problem("chunk_kda", q=q, k=k, v=v, gk=g, beta=p.beta, delta=True, gva=True, gate_in_op="kda",
                      A_log=torch.zeros(HV), use_qk_l2norm=True)
    sm90.launch(p, p.beta, 2, total, (None, None), *out, torch.empty(total, HV, K))
    ((grid, args, kw),) = launches
    assert args[names.index("a_kk")].dtype == torch.float16                 # (the softplus gate decays too)
    assert kw["FLAG"] is True and [name for name, _ in order] == ["wide", "inverse"]
    wide = order[0][1]
    flags = args[names.index("flags")]
    assert flags.shape == (total, HV) and flags.dtype == torch.int32 and wide[-1] is flags
    assert wide[5] is args[names.index("a_kk")] is order[1][1][3] and wide[6] is out[1]
    # a given gate may rise: fp32
    launches.clear()
    p = build_problem("chunk_kda", q=q, k=k, v=v, gk=g, beta=p.beta, delta=True, gva=True, use_qk_l2norm=True)
    sm90.launch(p, p.beta, 2, total, (None, None), *out, torch.empty(total, HV, K))
    ((_, args, kw),) = launches
    assert args[names.index("a_kk")].dtype == torch.float32 and kw["FLAG"] is True


def test_kda_prologue_serves_every_gate(monkeypatch):
    """The sm_90 prologue takes the bounded gate computed in the op, the unbounded and the given
    (bf16 or fp32) gates (their widest blocks flagged for the wide-block kernel); with UNBOUNDED off
    only the bounded gate (lower_bound >= -5). Not K % 32 != 0, nor an fp16 gate; a strided gate
    once the tier has made it dense."""
    import torch

    from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90
    from fastla.backends.triton import chunk_delta as triton_chunk
    from fastla.core.validation import build_problem

    B, T, H, K = 1, 128, 2, 64
    q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn(B, T, H, K, dtype=torch.bfloat16)
    beta = torch.rand(B, T, H, dtype=torch.bfloat16)
    common = dict(q=q, k=k, v=v, beta=beta, delta=True, gva=True)
    gate = dict(gate_in_op="kda", A_log=torch.zeros(H))
    bounded = build_problem("chunk_kda", **common, gk=g, **gate, lower_bound=-5.0)
    unbounded = [build_problem("chunk_kda", **common, gk=g, **gate),
                 build_problem("chunk_kda", **common, gk=g),
                 build_problem("chunk_kda", **common, gk=g.float()),
                 build_problem("chunk_kda", **common, gk=g, **gate, lower_bound=-8.0)]
    assert sm90.serves(bounded) is None
    assert sm90.serves(build_problem("chunk_kda", **common, gk=g, gate_in_op="kda", lower_bound=-1.0)) is None
    assert all(sm90.serves(p) is None for p in unbounded)
    assert "bf16 or fp32" in sm90.serves(build_problem("chunk_kda", **common, gk=g.half()))
    strided = torch.randn(B, T, K, H, dtype=torch.bfloat16).transpose(2, 3)    # the tier's run makes it dense
    dense = triton_chunk.dense_inputs(build_problem("chunk_kda", **common, gk=strided), align=16)
    assert dense.gk.is_contiguous() and dense.gk.data_ptr() % 16 == 0 and torch.equal(dense.gk, strided)
    assert dense.q is q and sm90.serves(dense) is None
    qkv48 = {n: x[..., :48].contiguous() for n, x in dict(q=q, k=k, v=v).items()}
    narrow = build_problem("chunk_kda", **dict(common, **qkv48), gk=g[..., :48].contiguous())
    assert "multiple of 32" in sm90.serves(narrow)
    monkeypatch.setattr(sm90, "UNBOUNDED", False)
    assert sm90.serves(bounded) is None
    assert all("bounded" in sm90.serves(p) for p in unbounded)
