"""One fastla chunked forward on a registry shape, for Nsight Compute (any prefill row: KDA's
prologue and scan, GDN's inverse and scan). --no-gates-in-scan clears KDA's GATES_IN_SCAN (the
prologue writes kg, qg and kd, the scan reads them).

    ncu --kernel-name regex:_kda_prologue --launch-count 1 python benchmarks/prefill_once.py kda/h64/1x8192
    ncu --kernel-name regex:_gdn_inverse --launch-count 1 python benchmarks/prefill_once.py gdn/h16-hv64/1x32768
"""
import sys

import torch

import fastla  # noqa: F401  (registers the tiers)
from fastla.backends.gluon import chunk_delta as gluon_chunk
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.bench.runner import load_op

args = [a for a in sys.argv[1:] if not a.startswith("--")]
if "--no-gates-in-scan" in sys.argv:
    gluon_chunk.GATES_IN_SCAN = False
cfg = get_config(args[0] if args else "kda/h64/1x8192")
kw = call_kwargs(make_inputs(cfg, "cuda"))
with torch.no_grad():
    load_op("fastla", cfg)(**kw)
torch.cuda.synchronize()
