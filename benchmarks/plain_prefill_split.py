"""Where the plain rule's prefill time goes (GLA, Simple GLA, Lightning; docs/notes/plain-prefill.md):
each kernel tier's CUDA-graph time and per-kernel split against FLA 0.6.0's, in one process, on the
registry's configs, with the byte floor of the call (q, k, v read and o written once, bf16; GLA's
per-channel gate read once; the fp32 initial state read and final state written once). ``--segments 16,32`` adds
gluon-tier rows with the sequence split into segments of that many chunks (the plan's choice
otherwise).

    python benchmarks/plain_prefill_split.py [--out DIR] [--shapes gla/h32/1x8192,simple_gla/h64/1x8192]
        [--segments 16,32]
"""
from __future__ import annotations

import argparse
import os

import torch

import fastla  # noqa: F401  (registers the tiers)
from benchmarks.gdn_prefill_sweep import config_with, rel, save_rows, split_text, timed
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.backends.triton import chunk_delta as triton_chunk
from fastla.bench.runner import load_op
from fastla.core import call_plan
from fastla.core.dispatch import use_tier

SHAPES = "gla/h32/1x8192,simple_gla/h64/1x8192,lightning/h64/1x8192,simple_gla/h64/1x32768"
HBM_BYTES_PER_S = 4.8e12
call_plan.ENABLED = False       # the segment variants change the plan between calls of one signature
PLANNED = triton_chunk.default_config


def floor_us(cfg) -> float:
    """Microseconds to move the call's compulsory bytes at the H200's HBM rate."""
    token_heads = cfg.B * cfg.T * cfg.HV
    per_token_head = 2 * (2 * cfg.K + 2 * cfg.V) + (4 * cfg.K if cfg.op == "chunk_gla" else 0)
    state = 2 * cfg.N * cfg.HV * cfg.K * cfg.V * 4
    return 1e6 * (token_heads * per_token_head + state) / HBM_BYTES_PER_S


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--segments", default="", help="chunks per segment, comma-separated (gluon rows)")
    args = ap.parse_args()
    variants = [("gluon", None), ("triton", None)] + [("gluon", int(n)) for n in args.segments.split(",") if n]
    rows = []
    for shape in args.shapes.split(","):
        cfg = get_config(shape)
        kw = call_kwargs(make_inputs(cfg, "cuda"))
        ours = load_op("fastla", cfg)
        print(f"{shape:28s} floor {floor_us(cfg):8.1f} us", flush=True)
        with torch.no_grad():
            with use_tier("gluon", strict=True):
                want = ours(**kw)[0]
            for tier, chunks in variants:
                case = tier if chunks is None else f"{tier} seg{chunks}"
                split = None if chunks is None else dict(segment_chunks=chunks)
                triton_chunk.default_config = config_with(PLANNED, split)
                try:
                    with use_tier(tier, strict=True):
                        o, us, split_us = timed(lambda: ours(**kw))
                finally:
                    triton_chunk.default_config = PLANNED
                rows.append(dict(shape=shape, case=case, us=us, kernels=split_us, err_vs_gluon=rel(o, want)))
                print(f"{shape:28s} {case:12s} {us:9.1f} us  vs gluon {rel(o, want):.1e}  {split_text(split_us)}",
                      flush=True)
            try:
                fla = load_op("fla", cfg)
            except Exception:
                fla = None
            if fla is not None:
                fo, us, split_us = timed(lambda: fla(**kw))
                rows.append(dict(shape=shape, case="FLA", us=us, kernels=split_us, err_vs_gluon=rel(fo, want)))
                print(f"{shape:28s} {'FLA':12s} {us:9.1f} us  vs gluon {rel(fo, want):.1e}  {split_text(split_us)}",
                      flush=True)
        kw = want = None
        torch.cuda.empty_cache()
        save_rows(os.path.join(args.out, "plain_prefill_split.json"), rows)     # after each shape
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
