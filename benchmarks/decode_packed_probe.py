"""Probe for the bf16-state decode (docs/notes/decode.md, Next 1): does holding the state tile as
loaded, bf16 pairs in int32 registers unpacked at each use, give the step more programs per SM and
more bytes in flight than the fp32 copy of the tile the decode kernel holds now?

Two reduced decode steps (one token, one value head's [K, BV] tile per program, a scalar decay,
the delta rule; no gate, norm or beta activation), on a bf16 state pool updated in place:
``plain`` converts the tile to fp32 once (as backends/triton/recurrent.py does); ``packed`` keeps
the loaded int32 pairs and unpacks each use through inline PTX marked impure, so that the compiler
neither merges the unpacks (then the fp32 copy is back: 255 registers) nor keeps their results.

    PYTHONPATH=. python benchmarks/decode_packed_probe.py --compile-only   # sm_90 registers, no GPU
    PYTHONPATH=. python benchmarks/decode_packed_probe.py                  # H200: error vs fp64, us

sm_90 compile on the CPU (Triton 3.6, K = V = 128, no spills): BV 32 / 1 warp plain 255 registers,
packed 182 (254 with the unpack marked pure); BV 32 / 2 warps 128 vs 96; BV 64 / 2 warps 254 vs
168. At 255 registers one-warp programs fit 8 to an SM, at 182 eleven. Not run on a GPU yet."""
from __future__ import annotations

import argparse
import tempfile

import torch
import triton
import triton.language as tl

K = V = 128
HV = 32


@triton.jit
def _unpack_lo(x, PURE: tl.constexpr):
    """The low bf16 of each int32 pair as fp32 (its bits shifted into the high half)."""
    return tl.inline_asm_elementwise("shl.b32 $0, $1, 16;", "=r,r", [x], dtype=tl.float32, is_pure=PURE, pack=1)


@triton.jit
def _unpack_hi(x, PURE: tl.constexpr):
    """The high bf16 of each int32 pair as fp32 (its low half cleared)."""
    return tl.inline_asm_elementwise("and.b32 $0, $1, 0xffff0000;", "=r,r", [x], dtype=tl.float32, is_pure=PURE,
                                     pack=1)


@triton.jit
def _plain_step(h, q, k, v, o, slots, decay, HVC: tl.constexpr, KC: tl.constexpr, VC: tl.constexpr,
                BV: tl.constexpr):
    i_p = tl.program_id(0)                                   # (sequence, head, V tile), tiles adjacent
    i_nh = i_p // (VC // BV)
    i_v = i_p % (VC // BV)
    i_n = i_nh // HVC
    i_hv = i_nh % HVC
    o_k = tl.arange(0, KC)
    o_v = i_v * BV + tl.arange(0, BV)
    slot = tl.load(slots + i_n).to(tl.int64)
    p_h = h + (slot * HVC + i_hv) * KC * VC + o_k[:, None] * VC + o_v[None, :]
    b_h = tl.load(p_h).to(tl.float32)                                                    # [K, BV]
    b_q = tl.load(q + i_nh * KC + o_k).to(tl.float32)                                    # [K]
    b_k = tl.load(k + i_nh * KC + o_k).to(tl.float32)
    b_v = tl.load(v + i_nh * VC + o_v).to(tl.float32)                                    # [BV]
    a = tl.load(decay + i_hv)
    hk = tl.sum(b_h * (a * b_k)[:, None], 0)
    hq = tl.sum(b_h * (a * b_q)[:, None], 0)
    u = b_v - hk
    tl.store(o + i_nh * VC + o_v, (hq + tl.sum(b_q * b_k) * u).to(tl.bfloat16))
    tl.store(p_h, (b_h * a + b_k[:, None] * u[None, :]).to(tl.bfloat16))


@triton.jit
def _packed_step(h, q, k, v, o, slots, decay, HVC: tl.constexpr, KC: tl.constexpr, VC: tl.constexpr,
                 BV: tl.constexpr, PURE: tl.constexpr):
    i_p = tl.program_id(0)
    i_nh = i_p // (VC // BV)
    i_v = i_p % (VC // BV)
    i_n = i_nh // HVC
    i_hv = i_nh % HVC
    BP: tl.constexpr = BV // 2
    o_k = tl.arange(0, KC)
    o_p = i_v * BP + tl.arange(0, BP)                                                    # pair columns
    slot = tl.load(slots + i_n).to(tl.int64)
    h32 = h.to(tl.pointer_type(tl.int32), bitcast=True)
    p_h = h32 + (slot * HVC + i_hv) * KC * (VC // 2) + o_k[:, None] * (VC // 2) + o_p[None, :]
    x = tl.load(p_h)                                                                     # [K, BV / 2] pairs
    b_q = tl.load(q + i_nh * KC + o_k).to(tl.float32)
    b_k = tl.load(k + i_nh * KC + o_k).to(tl.float32)
    v_lo, v_hi = tl.split(tl.reshape(tl.load(v + i_nh * VC + i_v * BV + tl.arange(0, BV)).to(tl.float32), [BP, 2]))
    a = tl.load(decay + i_hv)
    ak = (a * b_k)[:, None]
    aq = (a * b_q)[:, None]
    u_lo = v_lo - tl.sum(_unpack_lo(x, PURE) * ak, 0)                                   # [BV / 2]
    u_hi = v_hi - tl.sum(_unpack_hi(x, PURE) * ak, 0)
    qk = tl.sum(b_q * b_k)
    out_lo = tl.sum(_unpack_lo(x, PURE) * aq, 0) + qk * u_lo
    out_hi = tl.sum(_unpack_hi(x, PURE) * aq, 0) + qk * u_hi
    tl.store(o + i_nh * VC + i_v * BV + tl.arange(0, BV), tl.reshape(tl.join(out_lo, out_hi), [BV]).to(tl.bfloat16))
    n_lo = (_unpack_lo(x, PURE) * a + b_k[:, None] * u_lo[None, :]).to(tl.bfloat16).to(tl.int16, bitcast=True)
    n_hi = (_unpack_hi(x, PURE) * a + b_k[:, None] * u_hi[None, :]).to(tl.bfloat16).to(tl.int16, bitcast=True)
    tl.store(p_h, (n_hi.to(tl.int32) << 16) | (n_lo.to(tl.int32) & 0xFFFF))


VARIANTS = {   # name: (kernel, block_v, warps, extra constexprs)
    "plain-bv32-w1": (_plain_step, 32, 1, {}),
    "packed-bv32-w1": (_packed_step, 32, 1, {"PURE": False}),
    "packed-pure-bv32-w1": (_packed_step, 32, 1, {"PURE": True}),
    "plain-bv32-w2": (_plain_step, 32, 2, {}),
    "packed-bv32-w2": (_packed_step, 32, 2, {"PURE": False}),
    "plain-bv64-w2": (_plain_step, 64, 2, {}),
    "packed-bv64-w2": (_packed_step, 64, 2, {"PURE": False}),
}


def compile_only() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.backends.test_triton_sm90 import _resources

    pointers = {"h": "*bf16", "q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "slots": "*i32",
                "decay": "*fp32"}
    for name, (fn, bv, warps, extra) in VARIANTS.items():
        constexprs = dict(HVC=HV, KC=K, VC=V, BV=bv, **extra)
        names = fn.arg_names
        sig = {n: pointers.get(n, "constexpr") for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
        src = ASTSource(fn, sig, {(names.index(n),): c for n, c in constexprs.items()}, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        with tempfile.TemporaryDirectory() as folder:
            res = _resources(kernel.asm["cubin"], folder)
        print(f"{name:22s} registers {res['REG']:3d}  spill {res['STACK']:4d} B")


def on_gpu(N: int) -> None:
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(r(N, HV, K), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(r(N, HV, K), dim=-1).bfloat16()
    v = r(N, HV, V).bfloat16()
    decay = torch.rand(HV, device="cuda", generator=gen) * 0.5 + 0.5
    pool = (r(2 * N, HV, K, V) * 0.1).bfloat16()
    slots = torch.randperm(2 * N, device="cuda", generator=gen)[:N].int()
    S = pool[slots.long()].double()                                       # the reference step in fp64
    a = decay.double()[None, :, None, None]
    hk = torch.einsum("nhkv,nhk->nhv", S * a, k.double())
    u = v.double() - hk
    o_ref = torch.einsum("nhkv,nhk->nhv", S * a, q.double()) + (q.double() * k.double()).sum(-1, keepdim=True) * u
    s_ref = S * a + k.double()[..., None] * u[:, :, None, :]
    bytes_moved = 2 * N * HV * K * V * 2
    for name, (fn, bv, warps, extra) in VARIANTS.items():
        grid = (N * HV * (V // bv),)
        o = torch.full((N, HV, V), float("nan"), device="cuda", dtype=torch.bfloat16)
        p = pool.clone()
        fn[grid](p, q, k, v, o, slots, decay, HVC=HV, KC=K, VC=V, BV=bv, num_warps=warps, **extra)
        err_o = ((o.double() - o_ref).norm() / o_ref.norm()).item()
        err_s = ((p[slots.long()].double() - s_ref).norm() / s_ref.norm()).item()
        run = lambda: fn[grid](p, q, k, v, o, slots, decay, HVC=HV, KC=K, VC=V, BV=bv, num_warps=warps, **extra)  # noqa: E731
        us = 1e3 * do_bench_cudagraph(run, rep=200)
        print(f"{name:22s} N={N:4d} {us:8.1f} us  {bytes_moved / us / 1e6:5.2f} TB/s  "
              f"error o {err_o:.1e} state {err_s:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sizes", default="256,64")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
    else:
        for N in (int(x) for x in args.sizes.split(",")):
            on_gpu(N)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
