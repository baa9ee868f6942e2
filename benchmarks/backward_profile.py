"""Where a fwd + bwd call's GPU time goes, fastla's and FLA's side by side: the registry config's
inputs (``fastla.bench``), one warm call each, then STEPS calls under torch.profiler; one line per
kernel (mean microseconds per call, launches per call), largest first, and each library's total.

    python benchmarks/backward_profile.py gdn/h16-hv32/1x8192 [STEPS]

``KNOBS=chunk_delta_backward.DELTA_SCAN_FP32_PRODUCTS=0,...``: fastla's backward launch constants
(integers); ``TOP``: kernels listed per library (14); ``FLA=0``: fastla's only. FLA's gated dq/dk
kernel refuses Hopper under Triton < 3.7.1; its guard is bypassed here as the benchmark runner
does (fastla/bench/runner.py), its numbers timing only."""
import contextlib
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from fastla.bench.inputs import fresh_state, make_inputs
from fastla.bench.registry import get_config
from fastla.bench.runner import fla_bwd_guard_bypassed, fwdbwd_fn, load_op


def apply_knobs():
    """Sets the ``KNOBS`` constants of fastla.backends.triton's modules."""
    for knob in filter(None, os.environ.get("KNOBS", "").split(",")):
        path, value = knob.split("=")
        module, name = path.rsplit(".", 1)
        mod = __import__("fastla.backends.triton." + module, fromlist=[name])
        if not hasattr(mod, name):                  # (a misspelt or absent knob would time the default)
            raise ValueError(f"KNOBS: fastla.backends.triton.{module} has no {name}")
        setattr(mod, name, int(value))


def kernel_times(fn, steps):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
    return {n: (total[n] / steps, count[n] / steps) for n in total}


def main(name, steps=10):
    apply_knobs()
    cfg = get_config(name)
    inputs = fresh_state(make_inputs(cfg, "cuda", 0))
    for lib in ("fastla", "fla")[:2 if os.environ.get("FLA", "1") == "1" else 1]:
        fn = fwdbwd_fn(load_op(lib, cfg), inputs)
        with fla_bwd_guard_bypassed() if lib == "fla" else contextlib.nullcontext():
            rows = kernel_times(fn, steps)
        print(f"-- {lib} {name} fwd+bwd: {sum(t for t, _ in rows.values()):.0f} us of kernels per call")
        for n, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:int(os.environ.get("TOP", 14))]:
            print(f"{t:9.1f} us  x{c:g}  {n[:110]}")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
