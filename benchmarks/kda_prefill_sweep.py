"""KDA prefill sweep on the GPU: launch variants of the Triton chunked forward (the KDA prologue,
backends/triton/chunk_prepare_kda.py, and the scan's per-channel step) on registry shapes, against
FLA 0.6.0 in the same process: CUDA-graph time, per-kernel split, output error vs FLA.

    python benchmarks/kda_prefill_sweep.py [--out DIR] [--shapes NAME,..] [--variants default,bv32s3,..]
                                           [--gate op|unbounded|given]

--gate: ``op`` times the registry's options (bounded gate computed in the op); ``unbounded`` the
softplus gate in the op without lower_bound; ``given`` a precomputed bf16 log decay (FLA's
``fused_kda_gate`` output) with the gate options off. FLA runs the same call.
"""
from __future__ import annotations

import argparse
import os

import torch

import fastla  # noqa: F401  (registers the tiers)
from benchmarks.gdn_prefill_sweep import config_with, rel, save_rows, split_text, timed
from fastla.backends.gluon import chunk_delta as gluon_chunk
from fastla.backends.gluon import chunk_prepare_kda_sm90 as sm90_prologue
from fastla.backends.triton import chunk_delta
from fastla.backends.triton import chunk_prepare_kda_wide as wide
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.core import call_plan
from fastla.core.dispatch import use_tier
from fastla.ops.kda import chunk_kda

call_plan.ENABLED = False       # the sweeps change plan choices (tiles, prologues) between calls

VARIANTS = {
    "default": None,
    "prep-w1-bk16": dict(kda_prepare_warps=1, kda_prepare_block_k=16),
    "prep-w2-bk16": dict(kda_prepare_warps=2, kda_prepare_block_k=16),
    "prep-w4-bk16": dict(kda_prepare_warps=4, kda_prepare_block_k=16),
    "prep-w1-bk32": dict(kda_prepare_warps=1, kda_prepare_block_k=32),
    "prep-w2-bk32": dict(kda_prepare_warps=2, kda_prepare_block_k=32),
    "prep-w4-bk32": dict(kda_prepare_warps=4, kda_prepare_block_k=32),
    "prep-r168": dict(kda_prepare_maxnreg=168),
    "prep-triton": dict(sm90_prologue=False),     # the Gluon tier with the Triton prologue
    "dual": dict(scan_dual=True, scan_bv=64),      # the two-chain sm_90 scan at 64 columns (2 x 32)
    "dual-bv32": dict(scan_dual=True, scan_bv=32),
    "regs": dict(scan_regs=True, regs_chains=1),   # the state-in-registers scan (chunk_delta_regs_sm90.py)
    "regs2": dict(scan_regs=True, regs_chains=2),  # forced: one, two chains a program
    "no-regs": dict(scan_regs=False),              # the two-chain scan (before v26)
    "bv32-gluon": dict(scan_bv=32),                # the plain sm_90 scan at 32 columns
    "sm90-r168": dict(sm90_maxnreg=168),           # the sm_90 prologue capped (three programs per SM)
    "sm90-uncapped": dict(sm90_maxnreg=None),
    "sm90-r128": dict(sm90_maxnreg=128),
    "sm90-bounded-only": dict(sm90_unbounded=False),   # unbounded / given gates on the Triton prologue
    "inv-sm90": dict(inverse_sm90=True),           # P by the Gluon inverse kernel (chunk_inverse_sm90.py)
    "inv-triton": dict(inverse_sm90=False),        # P by the Triton inverse kernel
    "wide-bk32": dict(wide=(32, 4, 1)),             # the wide-block kernel's (channels, warps, stages)
    "wide-w8": dict(wide=(16, 8, 1)),
    "wide-bk32-w8": dict(wide=(32, 8, 1)),
    "wide-s2": dict(wide=(16, 4, 2)),
    "inv-w2": dict(inverse_warps=2),               # the inverse kernel's warps
    "inv-w4": dict(inverse_warps=4),
    "prep-w4-bk16-r128": dict(kda_prepare_warps=4, kda_prepare_block_k=16, kda_prepare_maxnreg=128),
    "prep-w2-bk16-r168": dict(kda_prepare_warps=2, kda_prepare_block_k=16, kda_prepare_maxnreg=168),
    "bv32s3": dict(scan_block_v=32, scan_stages=3, scan_warps=4),
    "bv32": dict(scan_block_v=32, scan_stages=2, scan_warps=4),
    "bv64w4": dict(scan_block_v=64, scan_stages=2, scan_warps=4),
    "bv128w8": dict(scan_block_v=128, scan_stages=2, scan_warps=8),
    "bv16": dict(scan_block_v=16, scan_stages=2, scan_warps=4),
    "no-segments": dict(segment_chunks=0),
    "seg16": dict(segment_chunks=16),
    "given-order": dict(longest_first=False),          # whole varlen sequences scanned in the given order
    "sm90-per-item": dict(sm90_programs_per_sm=None),   # the sm_90 prologue one program per item (not persistent)
    # the sm_90 prologue's builds (docs/notes/kda-prefill.md v19-v21; the default has both; the slice
    # loop's barriers 14 -> 4 in all of them since v21)
    "from-x": dict(bounded_operands=True, full_chunks=False),   # BOUNDED_OPERANDS
    "no-from-x": dict(bounded_operands=False, full_chunks=False),
    "full": dict(bounded_operands=False, full_chunks=True),   # FULL_CHUNKS
    "from-x-full": dict(bounded_operands=True, full_chunks=True),
    # KDA's gated keys and queries formed in the scan (GATES_IN_SCAN, docs/notes/kda-prefill.md v22):
    # the gater warpgroup on one chain; the prologue stores no kg, kd nor qg
    "gates-in-scan": dict(gates_in_scan=True),
    "tiles": dict(gates_in_scan=False),
    "regs1-tiles": dict(gates_in_scan=False, scan_regs=True, regs_chains=1),   # one chain, the prologue's tiles
    "gates-one-chain": dict(gates_in_scan=True, scan_regs=True, regs_chains=1),  # the gaters where two chains are planned
    "gates-packed": dict(gates_in_scan=True, gater_packed=True),   # the gaters' products on bf16 pairs (GATER_PACKED)
    "gates-fp32": dict(gates_in_scan=True, gater_packed=False),    # on fp32 (before v23)
    "loads-late": dict(loads_ahead=False),   # the prologue's bias and beta loaded where used (LOADS_AHEAD off, v23)
    "masks-always": dict(whole_branches=False),   # the scan's row masks on every chunk (WHOLE_CHUNK_BRANCHES off, v24)
    "beta-in-scan": dict(beta_in_p=False),   # beta applied in the scan's Y, P without it (BETA_IN_P off, v27)
    "a-fp32": dict(a_fp16=False),   # the sm_90 prologue's A scratch in fp32 everywhere (A_FP16 off, v32)
    "a-fp16": dict(a_fp16=True),    # in fp16 where |A| <= 2 (A_FP16 on)
}
SHAPES = "kda/h64/1x8192,kda/h64/2x16384,kda/h96/varlen8x15193"


def with_gate(kw: dict, gate: str) -> dict:
    """The registry's KDA call with the gate path ``gate`` (see the module docstring)."""
    if gate == "op":
        return kw
    kw = dict(kw, safe_gate=False)
    kw.pop("lower_bound", None)
    if gate == "given":
        A_log, dt_bias = kw.pop("A_log"), kw.pop("dt_bias")
        g = kw["g"].float() + dt_bias.view(-1, kw["g"].shape[-1]).float()
        kw["g"] = (-A_log.float().exp().view(-1, 1) * torch.nn.functional.softplus(g)).to(kw["g"].dtype)
        kw["use_gate_in_kernel"] = False
    return kw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--variants", default="default")
    ap.add_argument("--tier", default="triton", help="the tier the variants run on (triton, gluon)")
    ap.add_argument("--gate", default="op", choices=("op", "unbounded", "given"))
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    try:
        from fla.ops.kda import chunk_kda as fla_op
    except Exception:
        fla_op = None
    rows = []
    original = chunk_delta.default_config
    default_maxnreg, default_unbounded = sm90_prologue.MAXNREG, sm90_prologue.UNBOUNDED
    default_programs = sm90_prologue.PROGRAMS_PER_SM
    default_inverse = sm90_prologue.INVERSE_SM90
    default_from_x = sm90_prologue.BOUNDED_OPERANDS
    default_full = sm90_prologue.FULL_CHUNKS
    default_wide = wide.BLOCK_K, wide.WARPS, wide.STAGES
    default_dual = gluon_chunk.SCAN_DUAL
    default_regs = gluon_chunk.SCAN_REGS
    default_gates = gluon_chunk.GATES_IN_SCAN
    default_packed = gluon_chunk.GATER_PACKED
    default_ahead = sm90_prologue.LOADS_AHEAD
    default_whole = gluon_chunk.WHOLE_CHUNK_BRANCHES
    default_beta_in_p = gluon_chunk.BETA_IN_P
    default_a_fp16 = sm90_prologue.A_FP16
    for shape in args.shapes.split(","):
        kw = with_gate(call_kwargs(make_inputs(get_config(shape), "cuda")), args.gate)
        fla_o = fla_us = first_o = None
        if fla_op is not None:
            fla_o, fla_us, fla_split = timed(lambda: fla_op(**kw))
            print(f"{shape:24s} FLA {fla_us:9.1f} us: " + split_text(fla_split),
                  flush=True)
        for name in names:
            over = dict(VARIANTS[name] or {})
            gluon_chunk.KDA_PROLOGUE_SM90 = over.pop("sm90_prologue", True)
            sm90_prologue.MAXNREG = over.pop("sm90_maxnreg", default_maxnreg)
            sm90_prologue.INVERSE_WARPS = over.pop("inverse_warps", 1)
            sm90_prologue.INVERSE_SM90 = over.pop("inverse_sm90", default_inverse)
            sm90_prologue.UNBOUNDED = over.pop("sm90_unbounded", default_unbounded)
            sm90_prologue.PROGRAMS_PER_SM = over.pop("sm90_programs_per_sm", default_programs)
            sm90_prologue.BOUNDED_OPERANDS = over.pop("bounded_operands", default_from_x)
            sm90_prologue.FULL_CHUNKS = over.pop("full_chunks", default_full)
            sm90_prologue.LOADS_AHEAD = over.pop("loads_ahead", default_ahead)
            wide.BLOCK_K, wide.WARPS, wide.STAGES = over.pop("wide", default_wide)
            gluon_chunk.SCAN_DUAL = over.pop("scan_dual", default_dual)
            gluon_chunk.SCAN_BLOCK_V = over.pop("scan_bv", None)
            gluon_chunk.LONGEST_FIRST = over.pop("longest_first", True)
            gluon_chunk.SCAN_REGS = over.pop("scan_regs", default_regs)
            gluon_chunk.REGS_CHAINS = over.pop("regs_chains", None)
            gluon_chunk.GATES_IN_SCAN = over.pop("gates_in_scan", default_gates)
            gluon_chunk.GATER_PACKED = over.pop("gater_packed", default_packed)
            gluon_chunk.WHOLE_CHUNK_BRANCHES = over.pop("whole_branches", default_whole)
            gluon_chunk.BETA_IN_P = over.pop("beta_in_p", default_beta_in_p)
            sm90_prologue.A_FP16 = over.pop("a_fp16", default_a_fp16)
            chunk_delta.default_config = config_with(original, over)
            try:
                with use_tier(args.tier, strict=True), torch.no_grad():
                    o, us, split = timed(lambda: chunk_kda(**kw))
                    err_fla = rel(o, fla_o) if fla_o is not None else None
                    first_o = o if first_o is None else first_o
                    err_first = rel(o, first_o)
            except Exception as exc:  # a variant that does not compile or launch is reported, not fatal
                print(f"{shape:24s} {name:12s} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append(dict(shape=shape, variant=name, error=str(exc)[:400]))
                continue
            finally:
                chunk_delta.default_config = original
                gluon_chunk.KDA_PROLOGUE_SM90 = True
                sm90_prologue.MAXNREG, sm90_prologue.INVERSE_WARPS = default_maxnreg, 1
                sm90_prologue.UNBOUNDED = default_unbounded
                sm90_prologue.PROGRAMS_PER_SM = default_programs
                sm90_prologue.INVERSE_SM90, sm90_prologue.BOUNDED_OPERANDS = default_inverse, default_from_x
                sm90_prologue.FULL_CHUNKS, sm90_prologue.LOADS_AHEAD = default_full, default_ahead
                wide.BLOCK_K, wide.WARPS, wide.STAGES = default_wide
                gluon_chunk.SCAN_DUAL, gluon_chunk.SCAN_BLOCK_V = default_dual, None
                gluon_chunk.LONGEST_FIRST = True
                gluon_chunk.SCAN_REGS = default_regs
                gluon_chunk.REGS_CHAINS = None
                gluon_chunk.GATES_IN_SCAN = default_gates
                gluon_chunk.GATER_PACKED = default_packed
                gluon_chunk.WHOLE_CHUNK_BRANCHES = default_whole
                gluon_chunk.BETA_IN_P = default_beta_in_p
                sm90_prologue.A_FP16 = default_a_fp16
            prep = sum(v for k, v in split.items() if any(w in k for w in ("prepare", "prologue", "inverse", "wide", "list")))
            scan = sum(v for k, v in split.items() if "scan" in k)
            rows.append(dict(shape=shape, variant=name, tier=args.tier, gate=args.gate, us=us, prepare_us=prep, scan_us=scan, kernels=split,
                             err_vs_fla=err_fla, err_vs_first=err_first, fla_us=fla_us))
            speed = f"{fla_us / us:5.2f}x" if fla_us else "  -  "
            print(f"{shape:24s} {args.tier:6s} {name:12s} {us:9.1f} us (prepare {prep:8.1f}, scan {scan:8.1f}) FLA {fla_us or 0:9.1f} "
                  f"{speed} | vs FLA {err_fla if err_fla is None else f'{err_fla:.1e}'}, vs first {err_first:.1e}",
                  flush=True)
        kw = fla_o = first_o = None
        torch.cuda.empty_cache()
        save_rows(os.path.join(args.out, "kda_prefill_sweep.json"), rows)   # after each shape: a timeout keeps them
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
