"""Host time per call of the GDN chunked forward on the GPU, per tier: the wall time of issuing
calls back to back without synchronising (the launch queue absorbs them while the GPU lags),
the GPU time per call for comparison, and the host functions that cost the most (cProfile).

    python benchmarks/gdn_host_overhead.py [--shapes NAME,..] [--tiers gluon,triton] [--calls 50]
    python benchmarks/gdn_host_overhead.py --stub     # no GPU needed: launches stubbed

``--launch``: ``plan`` (the call plans replay a repeated call, fastla/core/call_plan.py),
``cached`` (the full host path with the cached launcher), ``triton`` (every launch through
Triton). ``--stub`` (fastla/bench/host_stub.py) times the host path on CPU tensors with the
compiled kernels' launchers stubbed (no driver call: ~5 us a launch on the GPU host is not in
it) and the tiers told that they can run; allocations are CPU allocations there."""
from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import time

import torch

import fastla  # noqa: F401  (registers the tiers)
from fastla.backends.triton import launch
from fastla.bench import host_stub
from fastla.bench.inputs import call_kwargs, make_inputs
from fastla.bench.registry import get_config
from fastla.core import call_plan
from fastla.core.dispatch import use_tier
from fastla.ops.gated_delta_rule import chunk_gated_delta_rule


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gdn/h2-hv8/1x8192,gdn/h4-hv16/1x8192,gdn/h16-hv64/varlen9x16384")
    ap.add_argument("--tiers", default="gluon,triton")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--launch", default="plan,cached,triton",
                    help="plan: call plans; cached: fastla's launcher, no plans; triton: Triton's launcher every time")
    ap.add_argument("--stub", action="store_true", help="CPU tensors, launches stubbed (no GPU needed)")
    ap.add_argument("--top", type=int, default=12, help="profile lines printed (by own time)")
    ap.add_argument("--breakdown", action="store_true",
                    help="with plans (GPU): time the replay's parts (signature, binding, each launch, allocations)")
    args = ap.parse_args()
    if args.stub:
        host_stub.install()
        args.launch = ",".join(x for x in args.launch.split(",") if x != "triton")
    for shape in args.shapes.split(","):
        kw = call_kwargs(make_inputs(get_config(shape), "cpu" if args.stub else "cuda"))
        if args.stub and "cu_seqlens" in kw:
            # (on the CPU both offsets would be one tensor, which a call plan refuses to record: on
            # a GPU they are two, the device's and the host's)
            kw["cu_seqlens"] = kw["cu_seqlens"].clone()
        for tier, how in itertools.product(args.tiers.split(","), args.launch.split(",")):
            launch.CACHED = how != "triton"
            call_plan.ENABLED = how == "plan"
            with use_tier(tier, strict=True), torch.no_grad():
                call = lambda: chunk_gated_delta_rule(**kw)  # noqa: E731
                for _ in range(3):
                    call()
                _sync(args.stub)
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                host = (time.perf_counter() - start) / args.calls
                gpu = float("nan") if args.stub else _eager_wall(call, args.calls)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    call()
                prof.disable()
                _sync(args.stub)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"{shape:28s} {tier:7s} {how:6s} host {host * 1e6:7.1f} us per call, eager wall {gpu * 1e6:7.1f} us")
            print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
            if args.breakdown and how == "plan" and not args.stub:
                with use_tier(tier, strict=True), torch.no_grad():
                    _breakdown(call, kw)
    return 0


def _best(fn, calls: int = 20) -> float:
    """Host time per call of ``fn`` (us): the best of five loops, synchronised between loops."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return best * 1e6


def _breakdown(call, kw) -> None:
    """The parts of a replayed call, each timed alone (us)."""
    plan = chunk_gated_delta_rule.plan_of(**kw)
    if plan is None or isinstance(plan, str):
        print(f"  not planned: {plan}")
        return
    _, calls, workspace = plan.bind((), kw)           # noqa: F841 (the launches below use it)
    parts = [("whole call", _best(call)), ("signature", _best(lambda: call_plan._signature((), kw))),
             ("bind (allocations, arguments)", _best(lambda: plan.bind((), kw)))]
    for name, (fn, values) in zip(plan.kernels, calls[len(plan.copies):]):    # (the dense copies first)
        parts.append((f"launch {name} ({type(fn).__name__})", _best(lambda: fn(*values))))
    for a in plan.allocations:
        if a.__class__ is not int:
            parts.append((f"torch.empty {a[0]}", _best(lambda: torch.empty(a[0], dtype=a[1], device="cuda"))))
    parts.append(("torch.empty (workspace)", _best(lambda: torch.empty(plan.workspace, dtype=torch.uint8, device="cuda"))))
    print("\n".join(f"  {name:44s} {us:7.1f} us" for name, us in parts))


def _sync(stub: bool) -> None:
    if not stub:
        torch.cuda.synchronize()


def _eager_wall(call, calls: int) -> float:
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    events[0].record()
    for _ in range(calls):
        call()
    events[1].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]) / calls * 1e-3


if __name__ == "__main__":
    raise SystemExit(main())
