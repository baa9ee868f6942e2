"""Decode kernel sweep on the GPU: every (block_v, num_warps) of the Triton recurrent kernel
against the heuristic's choice and FLA 0.6.0, for GDN and KDA at N in {1, 16, 64, 256}, HV 32,
fp32 and bf16 state, with the state pool updated in place (the serving form) and FLA's form
(initial_state in, a new final state out). CUDA-graph replay times; each config is first
checked against the fp64 reference (NaN-poisoned outputs).

    python benchmarks/decode_sweep.py [--out DIR] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

import fastla  # noqa: F401
from fastla.backends.triton import recurrent
from fastla.core.reference import reference_for
from fastla.core.validation import build_problem
from gdn_prefill_sweep import save_rows    # (this folder: the sweeps' shared helpers)

K = V = 128
HV = 32


def make(op: str, N: int, state_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    H = 16 if op == "gdn" else 32
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    t = dict(q=r(N, 1, H, K).bfloat16(), k=r(N, 1, H, K).bfloat16(), v=r(N, 1, HV, V).bfloat16(),
             beta=r(N, 1, HV).bfloat16(), A_log=r(HV) * 0.3, dt_bias=r(HV * K if op == "kda" else HV))
    t["g"] = r(N, 1, HV, K) if op == "kda" else r(N, 1, HV)
    slots = 2 * N
    pool = (r(slots, HV, K, V) * 0.1).to(state_dtype)
    idx = torch.randperm(slots, device="cuda", generator=gen)[:N].to(torch.int32)
    return t, pool, idx


def problem(op, t, pool, idx, pooled: bool):
    common = dict(q=t["q"], k=t["k"], v=t["v"], beta=t["beta"], delta=True, gva=True, A_log=t["A_log"],
                  dt_bias=t["dt_bias"], use_qk_l2norm=True, beta_sigmoid=True)
    gate = dict(g=t["g"], gate_in_op="gdn") if op == "gdn" else dict(gk=t["g"], gate_in_op="kda", lower_bound=-5.0)
    if pooled:
        return build_problem(f"fused_recurrent_{op}", **common, **gate, initial_state=pool, ssm_state_indices=idx)
    return build_problem(f"fused_recurrent_{op}", **common, **gate, initial_state=pool[:idx.numel()].float(),
                         output_final_state=True)


def rel(x, ref):
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def check(op, t, pool, idx, config) -> float:
    """Error of the pooled call vs the fp64 reference on the gathered start states."""
    p0 = problem(op, t, pool.clone(), idx, pooled=True)
    start = pool[idx.long()].float()
    ref_p = problem(op, t, start, idx, pooled=False)
    ro, rh = reference_for(ref_p)
    o, _ = recurrent.run(p0, config)
    return max(rel(o, ro), rel(p0.initial_state[idx.long()], rh))


def fla_call(op, t, h0):
    if op == "gdn":
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_gdn
        return lambda: fla_gdn(t["q"], t["k"], t["v"], t["g"], beta=t["beta"], initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=t["A_log"],
                         dt_bias=t["dt_bias"], use_beta_sigmoid_in_kernel=True)
    from fla.ops.kda import fused_recurrent_kda as fla_kda
    return lambda: fla_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                     initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="1,16,64,256", help="comma-separated batch sizes N")
    ap.add_argument("--form", default="pool", choices=("pool", "fla"),
                    help="time the pool updated in place, or FLA's form (a separate fp32 h0 in, a new final "
                         "state out: the registry's, which streams the state from HBM where a small pool stays in L2)")
    ap.add_argument("--states", default="float32,bfloat16")
    args = ap.parse_args()
    rep = 30 if args.quick else 100
    try:
        import fla  # noqa: F401
        have_fla = True
    except Exception:
        have_fla = False
    rows = []
    for op in ("gdn", "kda"):
        for N in [int(x) for x in args.sizes.split(",")]:
            for sd in [getattr(torch, x) for x in args.states.split(",")]:
                if args.form == "fla" and sd != torch.float32:
                    continue                    # FLA's form keeps an fp32 state
                t, pool, idx = make(op, N, sd)
                bytes_state = 2 * N * HV * K * V * pool.element_size()
                p = problem(op, t, pool, idx, pooled=args.form == "pool")
                default = recurrent.default_config(p)
                configs = [default] + [recurrent.DecodeConfig(bv, w) for bv in (8, 16, 32, 64, 128)
                                       for w in (1, 2, 4, 8) if (bv, w) != (default.block_v, default.num_warps)
                                       and K * bv // (32 * w) <= 256]       # state registers per thread
                best = None
                for cfg in configs:
                    err = check(op, t, pool, idx, cfg)
                    if not err < 1e-2:          # bf16 output rounding is ~2e-3
                        rows.append(dict(op=op, N=N, state=str(sd).replace("torch.", ""), bv=cfg.block_v, warps=cfg.num_warps, err=err,
                                         us=None, note="WRONG"))
                        continue
                    us = 1e3 * do_bench_cudagraph(lambda: recurrent.run(p, cfg), rep=rep)
                    row = dict(op=op, N=N, form=args.form, state=str(sd).replace("torch.", ""), bv=cfg.block_v,
                               warps=cfg.num_warps,
                               err=err, us=us, tbs=bytes_state / us / 1e6, default=cfg == default)
                    rows.append(row)
                    if best is None or us < best["us"]:
                        best = row
                fla_us = None
                if have_fla and sd == torch.float32:
                    h0 = pool[:N].float().clone()
                    fla_us = 1e3 * do_bench_cudagraph(fla_call(op, t, h0), rep=rep)
                if best is None:
                    print(f"{op} N={N} {sd}: every config failed the reference check", flush=True)
                    continue
                d = next((r for r in rows if r.get("default") and r["op"] == op and r["N"] == N
                          and r["state"] == str(sd).replace("torch.", "")), best)
                print(f"{op:4s} N={N:4d} {str(sd):15s} default bv={d['bv']:2d} w={d['warps']} {d['us']:7.2f} us "
                      f"{d['tbs']:5.2f} TB/s | best bv={best['bv']:2d} w={best['warps']} {best['us']:7.2f} us "
                      f"{best['tbs']:5.2f} TB/s | FLA {fla_us and round(fla_us, 2)} us", flush=True)
                rows.append(dict(op=op, N=N, state=str(sd), fla_us=fla_us, kind="fla"))
    path = os.path.join(args.out, f"decode_sweep-{args.form}.json")
    save_rows(path, rows)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
