"""Strided inputs on the GPU: what q, k, v split from one projection (the layout models pass: one
[B, T, 2 H K + HV V] tensor, split and viewed per head) cost against contiguous ones, for fastla's
dense copies (gluon_chunk.STRIDED_TMA off), its in-place TMA reads (on), and FLA 0.6.0 (whose
input_guard copies them), in one process: CUDA-graph time, the outputs bit-equal to the contiguous
call's (fastla) and the error vs FLA's.

    python benchmarks/strided_inputs.py [--out DIR] [--shapes gdn/h16-hv32/1x8192,kda/h64/1x8192]
"""
from __future__ import annotations

import argparse
import os

import torch
from triton.testing import do_bench_cudagraph

import fastla  # noqa: F401  (registers the tiers)
from benchmarks.gdn_prefill_sweep import rel, save_rows, split_text, timed
from fastla.backends.gluon import chunk_delta as gluon_chunk
from fastla.bench.host_stub import split_views
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.core import call_plan
from fastla.core.dispatch import use_tier
from fastla.ops import chunk_gated_delta_rule, chunk_kda

call_plan.ENABLED = False       # the variants change STRIDED_TMA between calls of one signature
IN_PLACE_DEFAULT = gluon_chunk.STRIDED_TMA
SHAPES = "gdn/h16-hv32/1x8192,gdn/h2-hv8/1x8192,kda/h64/1x8192"


def q_k_v_split(kw: dict) -> dict:
    """``kw`` with q, k and v split from one projection, the other tensors as they are."""
    views = split_views({n: kw[n] for n in ("q", "k", "v")})
    return dict(kw, **views)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=SHAPES)
    args = ap.parse_args()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
        from fla.ops.kda import chunk_kda as fla_kda
    except Exception:
        fla_gdn = fla_kda = None
    rows = []
    for shape in args.shapes.split(","):
        kw = call_kwargs(make_inputs(get_config(shape), "cuda"))
        split = q_k_v_split(kw)
        gdn = shape.startswith("gdn/")
        ours, fla = (chunk_gated_delta_rule, fla_gdn) if gdn else (chunk_kda, fla_kda)
        with torch.no_grad():
            with use_tier("gluon", strict=True):
                want = ours(**kw)[0]
            cases = [("contiguous", kw, False), ("split, copies", split, False), ("split, in place", split, True)]
            for name, inputs, in_place in cases:
                gluon_chunk.STRIDED_TMA = in_place
                try:
                    with use_tier("gluon", strict=True):
                        o, us, split_us = timed(lambda: ours(**inputs))
                finally:
                    gluon_chunk.STRIDED_TMA = IN_PLACE_DEFAULT
                rows.append(dict(shape=shape, case=name, us=us, kernels=split_us, equal=bool(torch.equal(o, want))))
                print(f"{shape:28s} fastla {name:16s} {us:9.1f} us  bit-equal {torch.equal(o, want)}  "
                      + split_text(split_us), flush=True)
            if fla is not None:
                for name, inputs in (("contiguous", kw), ("split", split)):
                    fo = fla(**inputs)[0]
                    us = 1e3 * do_bench_cudagraph(lambda: fla(**inputs), rep=100)
                    rows.append(dict(shape=shape, case=f"FLA {name}", us=us, err_vs_fastla=rel(fo, want)))
                    print(f"{shape:28s} FLA    {name:16s} {us:9.1f} us  vs fastla {rel(fo, want):.1e}", flush=True)
        kw = split = want = None
        torch.cuda.empty_cache()
        save_rows(os.path.join(args.out, "strided_inputs.json"), rows)     # after each shape
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
