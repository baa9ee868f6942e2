"""One KDA chunked forward on a registry shape (for Nsight Compute: the prologue's launches).

    ncu --kernel-name regex:_kda_prepare --launch-count 2 python benchmarks/kda_prologue_once.py [shape]
"""
import sys

import torch

import fastla  # noqa: F401  (registers the tiers)
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.ops.kda import chunk_kda

kw = call_kwargs(make_inputs(get_config(sys.argv[1] if len(sys.argv) > 1 else "kda/h64/1x8192"), "cuda"))
with torch.no_grad():
    chunk_kda(**kw)
torch.cuda.synchronize()
