"""Why the registry's CUDA-graph times sat above its eager ones on the largest rows (fastla on the
H200: gdn/h16-hv64/1x32768 1.375 vs 1.298 ms, kda/h64/2x16384 2.824 vs 2.702; FLA's within 1%),
while small rows show the reverse (launch overhead). The registry times eager calls with
``triton.testing.do_bench`` (the L2 flushed by a 256 MB memset before each call) and graphs with
``do_bench_cudagraph`` (``rep / estimate`` calls unrolled in one graph, back to back). This times
one row five ways, FLA beside it, and samples the SM clock and the power draw meanwhile:

- ``eager``: do_bench, the L2 flushed before each call (the registry's eager column, --quick's
  10 / 30 ms of warm-up / repetitions);
- ``eager-noflush``: calls back to back, events around 20 of them;
- ``graph``: do_bench_cudagraph (the registry's graph column, --quick's 10 ms);
- ``graph-1``: a graph of one call, replayed 20 times back to back;
- ``graph-gaps``: the same graph with a 0.5 ms sleep kernel between replays.

Answer (an H100, results/graph_vs_eager-h100.json): here all five agree within 1-2% at full
clocks, so not the power limit; the registry's gap was its first graph capture after the float64
reference (docs/notes/benchmarking.md), now measured once and discarded.

    python benchmarks/graph_vs_eager.py [--shapes kda/h64/2x16384,gdn/h16-hv64/1x32768] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import fastla  # noqa: F401  (registers the tiers)
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.bench.runner import load_op


class Sampler:
    """nvidia-smi's SM clock (MHz) and power (W) every 50 ms while active; the samples of a run."""

    def __init__(self):
        self.samples, self.proc, self.thread = [], None, None

    def __enter__(self):
        self.samples = []
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                          "-lms", "50"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return self
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                clock, power = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((clock, power))

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=1)

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clocks = [c for c, _ in self.samples]
        powers = [p for _, p in self.samples]
        return dict(samples=len(clocks), sm_mhz_min=min(clocks), sm_mhz_mean=sum(clocks) / len(clocks),
                    watts_max=max(powers), watts_mean=sum(powers) / len(powers))


def events_ms(run, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(calls)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def ways(call, gap_cycles: int) -> dict:
    """Milliseconds a call, each way (module docstring)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
    torch.cuda.synchronize()

    def back_to_back(n):
        for _ in range(n):
            call()

    def replays(n):
        for _ in range(n):
            graph.replay()

    def replays_with_gaps(n):
        for _ in range(n):
            torch.cuda._sleep(gap_cycles)
            graph.replay()

    found = {}
    for name, measure in (("eager", lambda: do_bench(call, warmup=10, rep=30, return_mode="median")),
                          ("eager-noflush", lambda: events_ms(back_to_back, 20)),
                          ("graph", lambda: do_bench_cudagraph(call, rep=10, return_mode="median")),
                          ("graph-1", lambda: events_ms(replays, 20)),
                          ("graph-gaps", lambda: events_ms(replays_with_gaps, 20))):
        measure()                                               # (warm, and the clocks settled)
        with Sampler() as s:
            ms = measure()
        found[name] = dict(ms=ms, **s.summary())
    if "graph-gaps" in found:                                   # (the sleeps' own time taken off)
        sleep_ms = events_ms(lambda n: [torch.cuda._sleep(gap_cycles) for _ in range(n)], 20)
        found["graph-gaps"]["ms"] -= sleep_ms
        found["graph-gaps"]["sleep_ms"] = sleep_ms
    return found


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kda/h64/2x16384,gdn/h16-hv64/1x32768,gdn/h16-hv32/1x8192")
    ap.add_argument("--libs", default="fastla,fla")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gap_cycles = int(0.5e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)     # ~0.5 ms
    rows = []
    for shape in args.shapes.split(","):
        cfg = get_config(shape)
        kw = call_kwargs(make_inputs(cfg, "cuda"))
        for lib in args.libs.split(","):
            try:
                op = load_op(lib, cfg)
            except ImportError as exc:
                print(f"{shape} {lib}: not importable ({exc})")
                continue
            with torch.no_grad():
                found = ways(lambda: op(**kw), gap_cycles)
            rows.append(dict(shape=shape, lib=lib, **found))
            print(f"{shape:26s} {lib:6s} " + "  ".join(
                f"{k} {v['ms']:.3f} ms" + (f" ({v['sm_mhz_mean']:.0f} MHz, {v['watts_mean']:.0f} W)" if "sm_mhz_mean" in v else "")
                for k, v in found.items()), flush=True)
            time.sleep(1.0)
        torch.cuda.empty_cache()
    path = os.path.join(args.out, "graph_vs_eager.json")
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
