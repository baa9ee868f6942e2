"""GDN prefill sweep on the GPU: launch variants of the Triton chunked forward
(backends/triton/chunk_delta.py) on registry shapes, against FLA 0.6.0 in the same process.

For each shape: every variant's output is compared with the first variant's and with FLA's
(relative RMS; the fp64 reference errors come from ``python -m fastla bench``), then timed by
CUDA-graph replay, with the per-kernel split from the profiler.

    python benchmarks/gdn_prefill_sweep.py [--out DIR] [--shapes NAME,..] [--variants all|default]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import triton
from triton.testing import do_bench_cudagraph

import fastla  # noqa: F401  (registers the tiers)
from fastla.backends.gluon import chunk_delta as gluon_chunk
from fastla.backends.triton import chunk_delta, chunk_prepare
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.core import call_plan
from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule

call_plan.ENABLED = False       # the sweeps change plan choices (tiles, prologues) between calls

VARIANTS = {
    "default": None,                       # chunk_delta.default_config(p)
    "gluon": None,                         # the sm_90 tier (its scan, the Triton prologue), default plan
    "gluon-plain": dict(SCAN_DUAL=False),  # gluon-*: overrides of backends/gluon/chunk_delta.py's constants
    "gluon-bv32": dict(SCAN_BLOCK_V=32),   # (the two-chain scan at every width unless SCAN_DUAL=False)
    "gluon-bv64": dict(SCAN_BLOCK_V=64),
    "gluon-ws-bv32": dict(SCAN_BLOCK_V=32, SCAN_SPECIALIZED=True),     # the warp-specialized scan
    "gluon-ws-bv64": dict(SCAN_BLOCK_V=64, SCAN_SPECIALIZED=True),
    "gluon-bv64-wg2": dict(SCAN_BLOCK_V=64, SCAN_WARPGROUPS=2, SCAN_DUAL=False),
    "gluon-plain-bv64": dict(SCAN_BLOCK_V=64, SCAN_DUAL=False),
    "gluon-plain-bv128": dict(SCAN_BLOCK_V=128, SCAN_DUAL=False),       # two warpgroups
    "gluon-dual-bv32": dict(SCAN_BLOCK_V=32, SCAN_DUAL=True),           # two chains of 16 columns
    "gluon-dual-bv64": dict(SCAN_BLOCK_V=64, SCAN_DUAL=True),           # two chains of 32 columns
    "gluon-dual-bv64-s3": dict(SCAN_BLOCK_V=64, SCAN_DUAL=True, SCAN_STAGES=3),
    "gluon-dual-bv128": dict(SCAN_BLOCK_V=128, SCAN_DUAL=True),         # two chains of 64 columns
    "gluon-combine-w4s1": dict(COMBINE_WARPS=4, COMBINE_STAGES=1),     # the segment combine's launch at
    "gluon-combine-w4s2": dict(COMBINE_WARPS=4, COMBINE_STAGES=2),     # COMBINE_BLOCK_V columns (two stages:
    "gluon-combine-w8s1": dict(COMBINE_WARPS=8, COMBINE_STAGES=1),     # the next summary prefetched)
    "gluon-combine-bv16": dict(COMBINE_BLOCK_V=16),                    # its value tile (16 ships: before
    "gluon-combine-bv32": dict(COMBINE_BLOCK_V=32),                    # v20 these variants ran at 32)
    "gluon-combine-bv64": dict(COMBINE_BLOCK_V=64),
    "gluon-combine-bv16-s3": dict(COMBINE_BLOCK_V=16, COMBINE_STAGES=3),
    "gluon-triton-scores": dict(GDN_SCORES_SM90=False),      # the Triton scores kernel on the sm_90 tier
    "gluon-triton-inverse": dict(GDN_INVERSE_SM90=False),    # the Triton inverse kernel on the sm_90 tier
    "gluon-inverse-vpp1": dict(inverse_heads=1),   # one value head a program (168 registers)
    "gluon-inverse-exp2": dict(INVERSE_EXP2=True),   # its A blocks' exponentials on ex2.approx.ftz
    "gluon-inverse-direct": dict(INVERSE_DIRECT_OPERANDS=True),   # its merges' operands converted once
    "gluon-inverse-exp2-direct": dict(INVERSE_EXP2=True, INVERSE_DIRECT_OPERANDS=True),
    "gluon-scores-in-scan": dict(SCORES_IN_SCAN=True),   # the scores formed in the scan (v32; the default)
    "gluon-scores-kernel": dict(SCORES_IN_SCAN=False),   # the scores kernel everywhere (before v32)
    "gluon-masks-always": dict(WHOLE_CHUNK_BRANCHES=False),   # the scan's masked stores on every chunk (before v34)
    "gluon-beta-in-scan": dict(BETA_IN_P=False),   # beta applied in the scan's Y, P without it (before v36)
    "gluon-summary": dict(SUMMARY_SM90=True),   # the segment summaries on the two-chain scan too
    "gluon-summary-seg16": dict(SUMMARY_SM90=True, segment_chunks=16),
    "gluon-summary-seg32": dict(SUMMARY_SM90=True, segment_chunks=32),
    "gluon-summary-seg64": dict(SUMMARY_SM90=True, segment_chunks=64),
    "gluon-bv128": dict(SCAN_BLOCK_V=128),
    "gluon-s3": dict(SCAN_BLOCK_V=64, SCAN_STAGES=3),   # three stages do not fit at 128 columns (216 KB at 64)
    "gluon-noseg": dict(segment_chunks=0),  # the plan's segments (sequence parallelism) on the sm_90 tier
    "gluon-seg8": dict(segment_chunks=8),
    "gluon-seg16": dict(segment_chunks=16),
    "gluon-seg32": dict(segment_chunks=32),
    "gluon-bv32-seg16": dict(SCAN_BLOCK_V=32, segment_chunks=16),
    "gluon-inv-vpp1": dict(inverse_heads=1),
    "gluon-inv-vpp2": dict(inverse_heads=2),
    "gluon-given-order": dict(LONGEST_FIRST=False),    # whole varlen sequences scanned in the given order
    "gluon-regs": dict(SCAN_REGS=True, REGS_CHAINS=1),    # the state-in-registers scan (chunk_delta_regs_
    "gluon-regs2": dict(SCAN_REGS=True, REGS_CHAINS=2),   # sm90.py) wherever it serves: one, two chains a program
    "gluon-no-regs": dict(SCAN_REGS=False),               # the two-chain scan everywhere (before v26)
    "gluon-no-pipe": dict(PIPELINE=False),   # GDN's prologue pieces under the scan (v27): off, forced pieces
    "gluon-pipe2": dict(PIPELINE_PIECES=2),
    "gluon-pipe8": dict(PIPELINE_PIECES=8),
    "gluon-all-summaries": dict(LAST_SEGMENT_SUMMARIES=True),   # the plan's split with the last segments'
                                                                # summaries too (before v28)
    "gluon-seg24": dict(segment_chunks=24),
    "gluon-s3-plan": dict(SCAN_STAGES=3),   # three stages in flight on the shipped plan (regs: 184 KB, two chains 216)
    "bv16": dict(scan_block_v=16, scan_stages=2, scan_warps=4),
    "bv32s2": dict(scan_block_v=32, scan_stages=2, scan_warps=4),
    "bv32s3": dict(scan_block_v=32, scan_stages=3, scan_warps=4),
    "bv64w4": dict(scan_block_v=64, scan_stages=2, scan_warps=4),
    "bv64w8": dict(scan_block_v=64, scan_stages=2, scan_warps=8),
    "scores-8w": dict(scores_warps=8),
    "inv-vpp1": dict(inverse_heads=1),
    "inv-w2": dict(inverse_warps=2),
    "inv-w4": dict(inverse_warps=4),
    "no-segments": dict(segment_chunks=0),
    "seg8": dict(segment_chunks=8),
    "seg16": dict(segment_chunks=16),
    "seg32": dict(segment_chunks=32),
}
SHAPES = "gdn/h16-hv64/1x32768,gdn/h2-hv8/1x32768,gdn/h16-hv32/4x8192,gdn/h16-hv64/varlen9x16384"


def problem_of(kw):
    from fastla.core.validation import build_problem
    return build_problem("chunk_gated_delta_rule", q=kw["q"], k=kw["k"], v=kw["v"], g=kw.get("g"),
                         beta=kw.get("beta"), delta=True, gva=True, cu_seqlens=kw.get("cu_seqlens"),
                         cu_seqlens_cpu=kw.get("cu_seqlens_cpu"))


def rel(x, ref):
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def save_rows(path: str, rows: list, **extra) -> None:
    """The sweep's rows to ``path`` as JSON, with the GPU and the torch and Triton versions."""
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       **extra, rows=rows), f, indent=1)


def config_with(original, fields: dict | None):
    """A default_config giving ``original``'s plan with ``fields`` replaced (none: ``original``)."""
    if not fields:
        return original
    return lambda p, **kw: dataclasses.replace(original(p, **kw), **fields)


def timed(call) -> tuple[torch.Tensor, float, dict[str, float]]:
    """The call's first output, its CUDA-graph time in microseconds and its per-kernel split."""
    o = call()[0]
    return o, 1e3 * do_bench_cudagraph(call, rep=100), kernel_split(call)


def split_text(split: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in split.items())


def kernel_split(fn) -> dict[str, float]:
    """Microseconds per call of each kernel, from the profiler over 10 calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0):
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t:
                out[e.key[:40]] = t / 10
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--variants", default="all")
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    except Exception:
        fla_op = None
    rows = []
    original = chunk_delta.default_config
    programs_per_sm = chunk_prepare.INVERSE_PROGRAMS_PER_SM
    for shape in args.shapes.split(","):
        cfg = get_config(shape)
        inputs = make_inputs(cfg, "cuda")
        kw = call_kwargs(inputs)
        fla_o = fla_us = None
        if fla_op is not None:
            fla_o, fla_us, fla_split = timed(lambda: fla_op(**kw))
            print(f"{shape:28s} FLA {fla_us:9.1f} us: " + split_text(fla_split),
                  flush=True)
        first = None
        for name in names:
            over = VARIANTS[name]
            tier = "gluon" if name.startswith("gluon") else "triton"
            # (upper-case keys: constants of the sm_90 tier's module, else of the Triton driver's)
            owner = {a: gluon_chunk if hasattr(gluon_chunk, a) else chunk_delta
                     for a in (over or {}) if a.isupper()} if tier == "gluon" else {}
            saved = {a: getattr(module, a) for a, module in owner.items()}
            for a, module in owner.items():
                setattr(module, a, over[a])
            if tier == "gluon":                    # lower-case keys: the launch plan (default_config) too
                over = {a: x for a, x in (over or {}).items() if not a.isupper()} or None
            chunk_delta.default_config = config_with(original, over)
            variant = chunk_delta.default_config
            # a variant's inverse_heads is what runs (not capped by the occupancy rule)
            chunk_prepare.INVERSE_PROGRAMS_PER_SM = 0 if "inverse_heads" in (over or {}) else programs_per_sm
            try:
                with use_tier(tier, strict=True), torch.no_grad():
                    o, us, split = timed(lambda: chunk_gated_delta_rule(**kw))
                    err_first = rel(o, first) if first is not None else 0.0
                    first = o if first is None else first
                    err_fla = rel(o, fla_o) if fla_o is not None else None
                    plan = gluon_chunk.plan if tier == "gluon" else variant            # (the sm_90 tier's split gain)
                    config = dataclasses.asdict(plan(problem_of(kw)))
            except Exception as exc:  # a variant that does not compile or launch is reported, not fatal
                print(f"{shape:28s} {name:16s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                rows.append(dict(shape=shape, variant=name, error=str(exc)[:400]))
                continue
            finally:
                chunk_delta.default_config = original
                chunk_prepare.INVERSE_PROGRAMS_PER_SM = programs_per_sm
                for a, value in saved.items():
                    setattr(owner[a], a, value)
            prep = sum(v for k, v in split.items() if "inverse" in k or "scores" in k)
            scan = sum(v for k, v in split.items() if "scan" in k)                # both tiers' scan kernels
            rows.append(dict(shape=shape, variant=name, config=config, us=us, prepare_us=prep,
                             scan_us=scan, kernels=split, err_vs_first=err_first, err_vs_fla=err_fla, fla_us=fla_us))
            speed = f"{fla_us / us:5.2f}x" if fla_us else "  -  "
            print(f"{shape:28s} {name:16s} {us:9.1f} us (prepare {prep:8.1f}, scan {scan:8.1f}) FLA {fla_us or 0:9.1f} "
                  f"{speed} | vs first {err_first:.1e} vs FLA {err_fla if err_fla is None else f'{err_fla:.1e}'} | "
                  + ", ".join(f"{k.split('(')[0][-24:]} {v:.0f}" for k, v in split.items()), flush=True)
        inputs = kw = fla_o = first = None                                 # free before the next shape
        torch.cuda.empty_cache()
        save_rows(os.path.join(args.out, "gdn_prefill_sweep.json"), rows)   # after each shape: a timeout keeps them
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
