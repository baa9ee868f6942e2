"""Timing probe: can GDN's prologue kernels run under the sm_90 scan on the same SMs?

The scan of a mid-lane shape (one sequence, 16-64 value heads) runs one program an SM and is
latency-bound (~1.4 us a chunk step at 32 columns); the prologue (inverse and scores kernels) runs
before it and takes a third of the time. This probe launches the scan first and the prologue
kernels on a side stream right after it, so both are resident together, and times the call by
CUDA-graph replay against the shipped order. The scan then reads the prologue's outputs of the
previous call (the same inputs, so the same values, at the same addresses in the steady state):
the times are what an overlapped pipeline could reach before any synchronization between the two;
the outputs are not checked here.

    python benchmarks/gdn_overlap_probe.py [--out DIR] [--shapes NAME,..] [--regs 128,..|none] [--chains 1,2]

Variants per shape: ``serial`` (as shipped), ``serial-rN`` (the scan at N registers a thread, the
chains' split CHAIN_REGS = N + 40), ``overlap-rN`` (that scan, the prologue beside it) and
``overlap`` (the shipped scan, the prologue beside it: no room, a control); ``serial-cN`` and
``overlap-cN``: the state-in-registers scan forced to N chains a program (REGS_CHAINS), whose
64-column programs leave SMs idle at the mid-lane shapes (v27 of docs/notes/gdn-prefill.md).
"""
from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench_cudagraph

import fastla  # noqa: F401  (registers the tiers)
from fastla.backends.gluon import chunk_delta as gluon_chunk
from fastla.backends.gluon import chunk_delta_dual_sm90 as dual
from fastla.backends.triton import chunk_delta
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.core import call_plan
from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule
from gdn_prefill_sweep import kernel_split, save_rows    # (this folder: the sweeps' shared helpers)

call_plan.ENABLED = False
SHAPES = "gdn/h8-hv32/1x8192,gdn/h16-hv32/1x8192,gdn/h16-hv32/1x32768,gdn/h16-hv64/1x8192,gdn/h16-hv64/1x32768"
_run = chunk_delta.run
_side: list[torch.cuda.Stream] = []


def _overlapped(p, config, sequence_scan=None, gdn_scores=None, gdn_inverse=None, **kw):
    """chunk_delta.run with the prologue kernels deferred and launched on a side stream after the
    first sequence pass (whole sequences: the only pass)."""
    if sequence_scan is None or gdn_scores is None or gdn_inverse is None:
        return _run(p, config, sequence_scan=sequence_scan, gdn_scores=gdn_scores, gdn_inverse=gdn_inverse, **kw)
    deferred = []

    def defer(fn):
        return lambda *args: deferred.append(lambda: fn(*args))

    def scan(*args):
        main = torch.cuda.current_stream()
        side = _side[0]
        side.wait_stream(main)
        sequence_scan(*args)
        with torch.cuda.stream(side):
            for launch in deferred:
                launch()
        deferred.clear()
        main.wait_stream(side)

    return _run(p, config, sequence_scan=scan, gdn_scores=defer(gdn_scores), gdn_inverse=defer(gdn_inverse), **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--regs", default="128", help="register caps of the two-chain scan ('none': no such variants)")
    ap.add_argument("--chains", default="", help="chains of the state-in-registers scan, forced (e.g. 1,2)")
    args = ap.parse_args()
    _side.append(torch.cuda.Stream())
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    except Exception:
        fla_op = None
    variants = [("serial", None, None, False), ("overlap", None, None, True)]
    for r in (int(x) for x in args.regs.split(",") if x != "none"):
        variants += [(f"serial-r{r}", r, None, False), (f"overlap-r{r}", r, None, True)]
    for c in (int(x) for x in args.chains.split(",") if x):
        variants += [(f"serial-c{c}", None, c, False), (f"overlap-c{c}", None, c, True)]
    chain_regs = dual.CHAIN_REGS
    rows = []
    for shape in args.shapes.split(","):
        kw = call_kwargs(make_inputs(get_config(shape), "cuda"))
        fla_us = 1e3 * do_bench_cudagraph(lambda: fla_op(**kw), rep=100) if fla_op else None
        for name, regs, chains, overlap in variants:
            gluon_chunk.SCAN_MAXNREG = regs
            gluon_chunk.REGS_CHAINS = chains
            dual.CHAIN_REGS = regs + 40 if regs else chain_regs
            chunk_delta.run = _overlapped if overlap else _run
            try:
                with use_tier("gluon", strict=True), torch.no_grad():
                    call = lambda: chunk_gated_delta_rule(**kw)  # noqa: E731
                    call()
                    us = 1e3 * do_bench_cudagraph(call, rep=100)
                    split = kernel_split(call) if not overlap else {}
            except Exception as exc:
                print(f"{shape:26s} {name:14s} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                rows.append(dict(shape=shape, variant=name, error=str(exc)[:400]))
                continue
            finally:
                chunk_delta.run = _run
                gluon_chunk.SCAN_MAXNREG = None
                gluon_chunk.REGS_CHAINS = None
                dual.CHAIN_REGS = chain_regs
            rows.append(dict(shape=shape, variant=name, us=us, kernels=split, fla_us=fla_us))
            print(f"{shape:26s} {name:14s} {us:8.1f} us  FLA {fla_us or 0:8.1f} ({(fla_us or 0) / us:4.2f}x) | "
                  + ", ".join(f"{k[:22]} {v:.0f}" for k, v in split.items()), flush=True)
        kw = None
        torch.cuda.empty_cache()
        save_rows(os.path.join(args.out, "gdn_overlap_probe.json"), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
