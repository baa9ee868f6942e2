"""The sm_90 streaming decode (backends/gluon/recurrent_sm90.py) against the Triton decode kernel
and FLA 0.6.0, GDN and KDA at HV 32, K = V = 128: the pool form (fp32 and bf16 states, 2N slots,
random slots) and FLA's form (fp32 h0 in, a new final state out). Every streaming plan swept is
first checked against the fp64 reference (outputs NaN-poisoned); CUDA-graph replay times.

    python benchmarks/decode_stream_sweep.py [--sizes 1,16,64,256] [--out DIR] [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(__file__))
from decode_sweep import HV, K, V, fla_call, make, problem, rel  # noqa: E402
from gdn_prefill_sweep import save_rows  # noqa: E402

import fastla  # noqa: F401,E402
from fastla.backends.gluon import recurrent as stream  # noqa: E402
from fastla.backends.triton import recurrent  # noqa: E402
from fastla.core import dispatch  # noqa: E402
from fastla.core.reference import reference_for  # noqa: E402

# (block_v, stages, programs per SM, warps); the kernel's earlier forms were swept with a fifth
# column, the compact [K] inputs, now always on (docs/notes/decode.md v6)
PLANS = {
    "float32": [(64, 3, 1, 4), (64, 2, 1, 4), (32, 2, 3, 4)],
    "bfloat16": [(64, 2, 3, 4), (32, 2, 4, 4)],
}
CASES = {"pool-fp32": ("pool", torch.float32), "pool-bf16": ("pool", torch.bfloat16), "fla-fp32": ("fla", torch.float32)}


def check(op, t, pool, idx, form, run) -> float:
    """Error of one call (pool form: the updated slots) vs the fp64 reference."""
    pool = pool.clone()
    p = problem(op, t, pool, idx, pooled=form == "pool")
    start = pool[idx.long()].float() if form == "pool" else p.initial_state
    ref_p = problem(op, t, start, idx, pooled=False)
    ro, rh = reference_for(ref_p)
    torch.full((pool.numel() // 2 + 4096,), float("nan"), device="cuda")          # freed: the outputs reuse it
    o, ht = run(p)
    return max(rel(o, ro), rel(pool[idx.long()] if form == "pool" else ht, rh))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="1,16,64,256")
    ap.add_argument("--ops", default="gdn,kda")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    args = ap.parse_args()
    rep = 30 if args.quick else 100
    rows = []
    for op in args.ops.split(","):
        for N in [int(x) for x in args.sizes.split(",")]:
            for form, sd in [CASES[c] for c in args.cases.split(",")]:
                t, pool, idx = make(op, N, sd)
                state_bytes = 2 * N * HV * K * V * pool.element_size()
                p = problem(op, t, pool, idx, pooled=form == "pool")
                line = dict(op=op, N=N, form=form, state=str(sd).replace("torch.", ""))
                name = f"fused_recurrent_{'gated_delta_rule' if op == 'gdn' else op}"
                runs = {"triton": lambda p: recurrent.run(p), "auto": lambda p, name=name: dispatch.run(name, p)}
                for plan in PLANS[line["state"]]:
                    runs["s" + "/".join(map(str, plan))] = lambda p, plan=stream.StreamPlan(*plan): stream.run(p, plan)
                res = {}
                for name, run in runs.items():
                    err = check(op, t, pool, idx, form, run)
                    if not err < 1e-2:
                        res[name] = dict(err=err, us=None)
                        print(f"  WRONG {op} N={N} {form} {sd} {name}: {err:.3e}", flush=True)
                        continue
                    us = 1e3 * do_bench_cudagraph(lambda: run(p), rep=rep)
                    res[name] = dict(err=err, us=us, tbs=state_bytes / us / 1e6)
                if form == "fla":
                    res["fla"] = dict(us=1e3 * do_bench_cudagraph(fla_call(op, t, pool[:N].float().clone()), rep=rep))
                line["results"] = res
                rows.append(line)
                ok = {n: r for n, r in res.items() if r.get("us") and n.startswith("s")}
                auto = res["auto"]["us"]
                best = min(ok, key=lambda n: ok[n]["us"]) if ok else None
                tri = res["triton"]["us"]
                msg = f"{op:3s} N={N:4d} {form:4s} {line['state']:8s} auto {auto:7.2f} triton {tri:7.2f}"
                if best:
                    msg += f" | stream best {best} {ok[best]['us']:7.2f} us {ok[best]['tbs']:4.2f} TB/s"
                    msg += " | " + " ".join(f"{n}:{r['us']:.1f}" for n, r in ok.items())
                if "fla" in res:
                    msg += f" | FLA {res['fla']['us']:.2f}"
                print(msg, flush=True)
    path = os.path.join(args.out, f"decode_stream_sweep-{args.cases.replace(',', '-')}.json")
    save_rows(path, rows, commit=os.environ.get("FASTLA_COMMIT"))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
