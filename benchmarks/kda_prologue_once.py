"""One KDA chunked forward on a registry shape (for Nsight Compute: the prologue's launches, or
the scan's with --gates-in-scan: the gated keys and queries formed in the scan, GATES_IN_SCAN).

    ncu --kernel-name regex:_kda_prepare --launch-count 2 python benchmarks/kda_prologue_once.py [shape] [--gates-in-scan]
"""
import sys

import torch

import fastla  # noqa: F401  (registers the tiers)
from fastla.backends.gluon import chunk_delta as gluon_chunk
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.ops.kda import chunk_kda

args = [a for a in sys.argv[1:] if not a.startswith("--")]
gluon_chunk.GATES_IN_SCAN = "--gates-in-scan" in sys.argv
kw = call_kwargs(make_inputs(get_config(args[0] if args else "kda/h64/1x8192"), "cuda"))
with torch.no_grad():
    chunk_kda(**kw)
torch.cuda.synchronize()
