"""The benchmark runner: times fastla against FLA 0.6.0 on the registry's configs.

``python -m fastla bench [--filter SUBSTR] [--modes fwd,fwdbwd,decode] [--out DIR]
[--no-fla] [--no-graph] [--no-cold] [--quick] ...`` (see :func:`parse_args`).

Per config the inputs are built once and shared by fastla, FLA and the reference. Per
mode (``fwd``, ``fwdbwd``, ``decode``):

1. correctness: one fastla call and one FLA call, compared with the float64 reference
   (the fastla op on float64 copies under ``use_tier("torch")``) by the relative RMS
   ``||x - ref|| / ||ref||`` of the output and final state (and of the gradients in
   ``fwdbwd`` when the reference backward is affordable), and with each other;
2. timing: ``triton.testing.do_bench`` (median, eager) and ``do_bench_cudagraph``
   (CUDA-graph replay; forward and decode only), for fastla then FLA;
3. a record with times, speedup (refused when fastla's error is over the limit),
   achieved TFLOP/s and GB/s, appended to the JSON file at once.

Cold starts (the first fastla call in a fresh process with an empty Triton cache) run
last, in parallel subprocesses, one per op and mode unless ``--cold-all``.
FLA 0.6.0 refuses GDN's backward on Hopper with Triton < 3.7.1; the runner bypasses that
guard for timing only and labels the record ``fla_note``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from fastla.bench.inputs import (
    BenchInputs, call_kwargs, fresh_state, make_inputs, to_float64, with_grad, work,
)
from fastla.bench.registry import CONFIGS, BenchConfig, get_config, parse_modes, select_configs

REL_ERR_LIMIT = 2e-2          # fastla's output / final state vs the float64 reference
GRAD_REL_ERR_LIMIT = 5e-2     # fastla's gradients vs the reference (or a trusted FLA)
GRAD_REF_MAX_TOKEN_HEADS = 1 << 19   # padded token-heads up to which the fp64 backward is run
PEAK_TFLOPS = 707.0           # H200, bf16 GEMM (BENCHMARKING.md)
PEAK_TBPS = 4.2               # H200, device copy (BENCHMARKING.md)
FLA_GUARD_TEXT = "chunk_bwd_dqkwg"
FLA_GUARD_NOTE = "guard bypassed, results not trusted"
REPO_ROOT = Path(__file__).resolve().parents[2]

Record = dict[str, Any]


@dataclass(frozen=True)
class Timing:
    """do_bench settings (milliseconds) and the wall-time budget of one config (seconds)."""

    warmup_ms: int = 25
    rep_ms: int = 100
    graph_rep_ms: int = 25
    budget_s: float = 120.0


QUICK_TIMING = Timing(warmup_ms=10, rep_ms=30, graph_rep_ms=10, budget_s=45.0)


# ----------------------------------------------------------------------------- arguments

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fastla bench", description="Time fastla against FLA 0.6.0.")
    p.add_argument("--filter", help="run configs whose name contains this (comma-separated: any of them)")
    p.add_argument("--modes", default="fwd,fwdbwd,decode", help="comma-separated subset of fwd,fwdbwd,decode")
    p.add_argument("--out", help="directory for the JSON file (default: benchmarks/results)")
    p.add_argument("--append", metavar="FILE", help="continue FILE: skip its (config, mode) records, add to it")
    p.add_argument("--no-fla", action="store_true", help="do not run FLA")
    p.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timing")
    p.add_argument("--no-cold", action="store_true", help="skip cold-start subprocesses")
    p.add_argument("--cold-all", action="store_true", help="cold start for every record, not one per op and mode")
    p.add_argument("--cold-jobs", type=int, default=4, help="cold-start subprocesses run at once")
    p.add_argument("--cold-timeout", type=float, default=300.0, help="seconds before a cold start is abandoned")
    p.add_argument("--quick", action="store_true", help="shorter warm-up, repetitions and budget")
    p.add_argument("--budget-s", type=float, help="wall-time budget of one config in seconds")
    p.add_argument("--max-rel-err", type=float, default=REL_ERR_LIMIT, help="refuse speedups above this error")
    p.add_argument("--time-limit-s", type=float, help="start no new config (nor cold starts) after this many seconds")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--list", action="store_true", help="list the selected configs and exit")
    p.add_argument("--tier", choices=("torch", "triton", "gluon"),
                   help="fastla tier to try first (sets FASTLA_BACKEND for this run and its cold starts)")
    return p.parse_args(argv)


def timing_from_args(args: argparse.Namespace) -> Timing:
    base = QUICK_TIMING if args.quick else Timing()
    if args.budget_s is None:
        return base
    return Timing(base.warmup_ms, base.rep_ms, base.graph_rep_ms, args.budget_s)


# ----------------------------------------------------------------------------- environment

def _run_text(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def fastla_commit() -> str:
    """``$FASTLA_COMMIT`` when set (a copied working tree may carry stale git metadata), else
    ``git rev-parse HEAD`` of the checkout (``-dirty`` when it has changes), else ``unknown``."""
    if os.environ.get("FASTLA_COMMIT"):
        return os.environ["FASTLA_COMMIT"]
    head = _run_text(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    if head is None:
        return "unknown"
    dirty = _run_text(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    return f"{head}-dirty" if dirty else head


def fla_version() -> tuple[str | None, str | None]:
    """(version, None) when ``import fla`` works, else (None, the reason)."""
    try:
        fla = importlib.import_module("fla")
    except Exception as exc:  # any import failure means "no FLA"
        return None, f"fla not importable: {_short(exc)}"
    return str(getattr(fla, "__version__", "unknown")), None


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def collect_metadata(fla: str | None) -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    driver = _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "driver": driver.splitlines()[0] if driver else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": fla,
        "commit": fastla_commit(),
        "python": platform.python_version(),
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "fastla_backend": os.environ.get("FASTLA_BACKEND") or "auto",
        "peak_tflops": PEAK_TFLOPS,
        "peak_tbps": PEAK_TBPS,
    }


def _short(exc: BaseException, limit: int = 240) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."


# ----------------------------------------------------------------------------- calls

def load_op(lib: str, cfg: BenchConfig) -> Callable[..., Any]:
    """The public op of ``cfg`` from ``fastla`` or ``fla``."""
    module = importlib.import_module(f"{lib}.ops.{cfg.spec.package}")
    return getattr(module, cfg.spec.function)


def _split(out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return out[0], out[1]


def loss_of(o: torch.Tensor, ht: torch.Tensor | None, inputs: BenchInputs) -> torch.Tensor:
    """``(o * do).sum() + (ht * dht).sum()``."""
    loss = (o * inputs.do).sum()
    if ht is not None and inputs.dht is not None:
        loss = loss + (ht * inputs.dht).sum()
    return loss


def forward_fn(op: Callable[..., Any], inputs: BenchInputs) -> Callable[[], Any]:
    kwargs = call_kwargs(inputs)
    return lambda: op(**kwargs)


def fwdbwd_fn(op: Callable[..., Any], inputs: BenchInputs) -> Callable[[], Any]:
    """One forward and backward through the public autograd API; returns the gradients
    of ``inputs.grad_names`` (None for inputs the op does not differentiate)."""
    ginputs, leaves = with_grad(inputs)
    kwargs = call_kwargs(ginputs)

    def step() -> tuple[torch.Tensor | None, ...]:
        o, ht = _split(op(**kwargs))
        return torch.autograd.grad(loss_of(o, ht, inputs), leaves, allow_unused=True)

    return step


@dataclass
class Result:
    """What one call produced: output, final state and (fwdbwd) gradients by name."""

    o: torch.Tensor
    ht: torch.Tensor | None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def run_once(op: Callable[..., Any], inputs: BenchInputs, grads: bool) -> Result:
    """One call on a fresh copy of the initial state (with gradients when ``grads``)."""
    inputs = fresh_state(inputs)
    if not grads:
        with torch.no_grad():
            o, ht = _split(op(**call_kwargs(inputs)))
        return Result(o.detach(), None if ht is None else ht.detach())
    ginputs, leaves = with_grad(inputs)
    o, ht = _split(op(**call_kwargs(ginputs)))
    gs = torch.autograd.grad(loss_of(o, ht, ginputs), leaves, allow_unused=True)
    return Result(o.detach(), None if ht is None else ht.detach(), dict(zip(inputs.grad_names, gs)))


@contextlib.contextmanager
def observe_tiers() -> Iterator[list[str]]:
    """Collects the tiers ``fastla.core.dispatch.select`` picks inside the block."""
    seen: list[str] = []
    try:
        dispatch = importlib.import_module("fastla.core.dispatch")
    except ImportError:
        yield seen
        return
    original = dispatch.select

    def spy(op: str, problem: Any) -> Any:
        chosen = original(op, problem)
        seen.append(chosen[0])
        return chosen

    dispatch.select = spy
    try:
        yield seen
    finally:
        dispatch.select = original


def tier_label(seen: list[str]) -> str:
    """The tiers that served the calls, fastest first, or the requested one."""
    if seen:
        order = ("gluon", "triton", "torch")
        return "+".join(sorted(set(seen), key=lambda t: order.index(t) if t in order else len(order)))
    return os.environ.get("FASTLA_BACKEND") or "auto"


@contextlib.contextmanager
def fla_bwd_guard_bypassed() -> Iterator[None]:
    """Let FLA's gated ``chunk_bwd_dqkwg`` run on Hopper with Triton < 3.7.1: its guard
    reads ``TRITON_ABOVE_3_7_1`` from ``fla.ops.common.chunk_o`` at call time."""
    module = importlib.import_module("fla.ops.common.chunk_o")
    saved = module.TRITON_ABOVE_3_7_1
    module.TRITON_ABOVE_3_7_1 = True
    try:
        yield
    finally:
        module.TRITON_ABOVE_3_7_1 = saved


def is_fla_guard(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and FLA_GUARD_TEXT in str(exc)


# ----------------------------------------------------------------------------- errors

def rel_err(x: torch.Tensor | None, ref: torch.Tensor | None) -> float | None:
    """``||x - ref|| / ||ref||`` in float64 (NaN when x has NaN); None when either is missing."""
    if x is None or ref is None:
        return None
    if x.shape != ref.shape:
        return math.nan
    x64, r64 = x.detach().double(), ref.detach().double()
    den = torch.linalg.vector_norm(r64)
    num = torch.linalg.vector_norm(x64 - r64)
    return float(num / den) if float(den) > 0 else float(num)


def worst(errors: Sequence[float | None]) -> float | None:
    """The largest error (NaN wins); None when none was measured."""
    known = [e for e in errors if e is not None]
    if not known:
        return None
    return math.nan if any(math.isnan(e) for e in known) else max(known)


def output_errors(res: Result, ref: Result) -> dict[str, float | None]:
    o, ht = rel_err(res.o, ref.o), rel_err(res.ht, ref.ht)
    return {"o": o, "ht": ht, "max": worst([o, ht])}


def grad_errors(res: Result, ref: Result) -> dict[str, float | None]:
    errs = {name: rel_err(g, ref.grads.get(name)) for name, g in res.grads.items()}
    return {**errs, "max": worst(list(errs.values()))}


def grad_reference_affordable(cfg: BenchConfig) -> bool:
    """The float64 backward of the torch tier keeps per-channel decays of every chunk
    (``C x C x K``) for autograd, so it runs only without a per-channel gate and up to a
    padded size."""
    padded = cfg.N * cfg.max_len * cfg.HV
    return cfg.spec.gate != "channel" and padded <= GRAD_REF_MAX_TOKEN_HEADS


def reference(cfg: BenchConfig, inputs: BenchInputs, grads: bool) -> Result:
    """The fastla op on float64 copies of ``inputs`` through the torch tier."""
    from fastla.core.dispatch import use_tier

    op = load_op("fastla", cfg)
    with use_tier("torch"):
        return run_once(op, to_float64(inputs), grads)


# ----------------------------------------------------------------------------- timing

def time_eager(fn: Callable[[], Any], timing: Timing) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=timing.warmup_ms, rep=timing.rep_ms, return_mode="median"))


def time_graph(fn: Callable[[], Any], timing: Timing) -> tuple[float | None, str | None]:
    """CUDA-graph replay time, or (None, why the capture or replay failed). Measured twice, the
    first discarded: the first capture after the float64 reference (tens of GB allocated and freed)
    replays 8-12% slower, for whichever library comes first (an H100, 2x16k KDA: fastla 3.21 ms
    first, 2.85 after; FLA 9.18 first, 8.23 after), and the run always timed fastla first; not
    the clocks (1980 MHz, no throttle reason) nor time (a 2 s sleep kept it), eager timings
    unaffected (docs/notes/benchmarking.md)."""
    from triton.testing import do_bench_cudagraph

    try:
        do_bench_cudagraph(fn, rep=timing.graph_rep_ms, return_mode="median")
        return float(do_bench_cudagraph(fn, rep=timing.graph_rep_ms, return_mode="median")), None
    except Exception as exc:  # a failed capture is a result, not a crash
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return None, _short(exc)


class Budget:
    """Wall-clock budget of one config's measurements; stages past it are skipped and
    listed. Time inside :meth:`excluded` (first calls: compilation and autotuning,
    which every config pays once) does not count."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.monotonic()
        self.not_counted = 0.0
        self.skipped: list[str] = []

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.not_counted += time.monotonic() - began

    def spent(self) -> float:
        return time.monotonic() - self.start - self.not_counted

    def allows(self, stage: str) -> bool:
        if self.spent() < self.seconds:
            return True
        self.skipped.append(stage)
        return False


# ----------------------------------------------------------------------------- one record

@dataclass
class RunContext:
    """Settings shared by every record of a run."""

    timing: Timing
    meta: dict[str, Any]
    fla_ok: bool
    fla_reason: str | None
    graph: bool
    max_rel_err: float
    device: str = "cuda"


class ReferenceCache:
    """The float64 reference of one config, computed on first use (with gradients when
    a ``fwdbwd`` record needs them and they are affordable)."""

    def __init__(self, cfg: BenchConfig, inputs: BenchInputs, grads: bool):
        self.cfg, self.inputs, self.grads = cfg, inputs, grads and grad_reference_affordable(cfg)
        self.result: Result | None = None
        self.note: str | None = None
        self.tried = False

    def get(self, budget: Budget) -> Result | None:
        if not self.tried and budget.allows("reference"):
            self.tried = True
            try:
                self.result = reference(self.cfg, self.inputs, self.grads)
            except Exception as exc:  # the record says why it has no reference
                self.note = f"reference failed: {_short(exc)}"
                free_memory()
        return self.result


def base_record(cfg: BenchConfig, mode: str, ctx: RunContext) -> Record:
    meta = ctx.meta
    return {
        "op": cfg.op, "config": cfg.name, "mode": mode, "family": cfg.family, "shape": cfg.describe(),
        "B": cfg.B, "T": cfg.T, "H": cfg.H, "HV": cfg.HV, "K": cfg.K, "V": cfg.V,
        "lengths": list(cfg.lengths) if cfg.lengths is not None else None,
        "options": dict(cfg.options), "dtype": cfg.dtype,
        "gpu": meta.get("gpu"), "torch": meta.get("torch"), "triton": meta.get("triton"),
        "fla": meta.get("fla"), "commit": meta.get("commit"),
        "fastla_tier_requested": os.environ.get("FASTLA_BACKEND") or "auto",
        "fla_note": None if ctx.fla_ok else ctx.fla_reason,
    }


def check_fastla(rec: Record, cfg: BenchConfig, inputs: BenchInputs, mode: str, ref: Result | None) -> Result | None:
    grads = mode == "fwdbwd"
    try:
        op = load_op("fastla", cfg)
        with observe_tiers() as seen:
            res = run_once(op, inputs, grads)
        synchronize()
    except Exception as exc:  # recorded; FLA still runs
        rec["fastla_error"] = _short(exc)
        free_memory()
        return None
    rec["fastla_tier"] = tier_label(seen)
    if ref is not None:
        errs = output_errors(res, ref)
        rec.update(fastla_rel_err=errs["max"], fastla_rel_err_o=errs["o"], fastla_rel_err_ht=errs["ht"])
        if grads and ref.grads:
            gerrs = grad_errors(res, ref)
            rec["fastla_grad_rel_err"] = gerrs.pop("max")
            rec["fastla_grad_rel_errs"] = gerrs
    return res


def check_fla(rec: Record, cfg: BenchConfig, inputs: BenchInputs, mode: str,
              ref: Result | None) -> tuple[Result | None, bool]:
    """One FLA call; returns its result and whether the backward guard had to be bypassed."""
    grads = mode == "fwdbwd"
    op = load_op("fla", cfg)
    bypass = False
    try:
        try:
            res = run_once(op, inputs, grads)
        except RuntimeError as exc:
            if not (grads and is_fla_guard(exc)):
                raise
            bypass = True
            with fla_bwd_guard_bypassed():
                res = run_once(op, inputs, grads)
        synchronize()
    except Exception as exc:  # recorded; fastla's numbers stand alone
        rec["fla_error"] = _short(exc)
        free_memory()
        return None, bypass
    if bypass:
        rec["fla_note"] = FLA_GUARD_NOTE
    if ref is not None:
        errs = output_errors(res, ref)
        rec.update(fla_rel_err=errs["max"], fla_rel_err_o=errs["o"], fla_rel_err_ht=errs["ht"])
        if grads and ref.grads:
            rec["fla_grad_rel_err"] = grad_errors(res, ref)["max"]
    return res, bypass


def compare(rec: Record, ours: Result | None, theirs: Result | None) -> None:
    if ours is None or theirs is None:
        return
    rec["fastla_vs_fla_rel_err"] = output_errors(ours, theirs)["max"]
    if ours.grads and theirs.grads:
        rec["fastla_vs_fla_grad_rel_err"] = grad_errors(ours, theirs)["max"]


def time_lib(rec: Record, prefix: str, fn: Callable[[], Any], mode: str, ctx: RunContext, budget: Budget) -> None:
    """Eager (and, for forward and decode, graph) times into ``<prefix>_ms_eager/_graph``."""
    rec[f"{prefix}_ms_eager"] = rec[f"{prefix}_ms_graph"] = None
    if budget.allows(f"{prefix} eager"):
        try:
            rec[f"{prefix}_ms_eager"] = time_eager(fn, ctx.timing)
        except Exception as exc:  # timing failure recorded
            rec[f"{prefix}_error"] = rec.get(f"{prefix}_error") or _short(exc)
            return
    if mode == "fwdbwd":
        rec[f"{prefix}_graph_note"] = "graph not timed for fwdbwd"
    elif not ctx.graph:
        rec[f"{prefix}_graph_note"] = "--no-graph"
    elif budget.allows(f"{prefix} graph"):
        rec[f"{prefix}_ms_graph"], rec[f"{prefix}_graph_note"] = time_graph(fn, ctx.timing)


def make_fn(lib: str, cfg: BenchConfig, inputs: BenchInputs, mode: str) -> Callable[[], Any]:
    op = load_op(lib, cfg)
    return fwdbwd_fn(op, inputs) if mode == "fwdbwd" else forward_fn(op, inputs)


def pick_times(rec: Record) -> None:
    """``fastla_ms``/``fla_ms`` of one kind for both: graph when both have it (or FLA
    was not timed), else eager."""
    fg, fe = rec.get("fastla_ms_graph"), rec.get("fastla_ms_eager")
    lg, le = rec.get("fla_ms_graph"), rec.get("fla_ms_eager")
    use_graph = fg is not None and (lg is not None or le is None)
    rec["timing"] = "graph" if use_graph else "eager"
    rec["fastla_ms"] = fg if use_graph else fe
    rec["fla_ms"] = lg if use_graph else le


def speedup_verdict(rec: Record, max_rel_err: float) -> tuple[float | None, str | None]:
    """``fla_ms / fastla_ms``, or None with the reason it is refused."""
    ours, theirs = rec.get("fastla_ms"), rec.get("fla_ms")
    if ours is None or theirs is None:
        return None, None
    err = rec.get("fastla_rel_err")
    source = "reference"
    if err is None and not rec.get("fla_note"):
        err, source = rec.get("fastla_vs_fla_rel_err"), "FLA"
    if err is None:
        return None, "no correctness check"
    if math.isnan(err) or err > max_rel_err:
        return None, f"fastla rel err vs {source} {err:.2e} > {max_rel_err:.0e}"
    gerr = rec.get("fastla_grad_rel_err")
    if gerr is None and not rec.get("fla_note"):
        gerr = rec.get("fastla_vs_fla_grad_rel_err")
    if gerr is not None and (math.isnan(gerr) or gerr > GRAD_REL_ERR_LIMIT):
        return None, f"fastla grad rel err {gerr:.2e} > {GRAD_REL_ERR_LIMIT:.0e}"
    note = "backward not checked" if rec["mode"] == "fwdbwd" and gerr is None else None
    return theirs / ours, note


def add_throughput(rec: Record, inputs: BenchInputs) -> None:
    flops, nbytes = work(inputs, rec["mode"])
    rec["flops"], rec["bytes"] = flops, nbytes
    ms = rec.get("fastla_ms")
    floor_ms = max(flops / (PEAK_TFLOPS * 1e12), nbytes / (PEAK_TBPS * 1e12)) * 1e3
    rec["floor_ms"] = floor_ms
    if ms:
        rec["tflops"] = flops / (ms * 1e-3) / 1e12
        rec["gbps"] = nbytes / (ms * 1e-3) / 1e9
        rec["roofline_frac"] = floor_ms / ms


def bench_mode(ctx: RunContext, inputs: BenchInputs, mode: str, refs: ReferenceCache, budget: Budget) -> Record:
    """Check, time and describe one (config, mode)."""
    cfg = inputs.cfg
    start = time.monotonic()
    rec = base_record(cfg, mode, ctx)
    ref = refs.get(budget)
    rec["ref_note"] = refs.note
    if mode == "fwdbwd" and not refs.grads:
        rec["grad_ref_note"] = "float64 backward reference skipped (too large for the torch tier)"
    ours, theirs, bypass = None, None, False
    with budget.excluded():
        ours = check_fastla(rec, cfg, inputs, mode, ref)
        if ctx.fla_ok:
            theirs, bypass = check_fla(rec, cfg, inputs, mode, ref)
    compare(rec, ours, theirs)
    del ours, theirs
    if "fastla_error" not in rec:
        time_lib(rec, "fastla", make_fn("fastla", cfg, inputs, mode), mode, ctx, budget)
    if ctx.fla_ok and "fla_error" not in rec:
        with fla_bwd_guard_bypassed() if bypass else contextlib.nullcontext():
            time_lib(rec, "fla", make_fn("fla", cfg, inputs, mode), mode, ctx, budget)
    pick_times(rec)
    rec["ratio"], rec["ratio_note"] = speedup_verdict(rec, ctx.max_rel_err)
    add_throughput(rec, inputs)
    rec["skipped"] = list(budget.skipped)
    rec["elapsed_s"] = time.monotonic() - start
    return rec


def bench_config(ctx: RunContext, cfg: BenchConfig, modes: Sequence[str], seed: int) -> Iterator[Record]:
    """The records of one config, one per mode (an unexpected failure becomes a record
    with ``error``); frees GPU memory at the end."""
    budget = Budget(ctx.timing.budget_s)
    try:
        inputs = make_inputs(cfg, ctx.device, seed)
    except Exception as exc:  # e.g. out of memory: every mode gets the reason
        free_memory()
        for mode in modes:
            yield {**base_record(cfg, mode, ctx), "error": f"inputs: {_short(exc)}"}
        return
    refs = ReferenceCache(cfg, inputs, grads="fwdbwd" in modes)
    try:
        for mode in modes:
            try:
                rec = bench_mode(ctx, inputs, mode, refs, budget)
            except Exception as exc:  # keep the run going; the record says what broke
                rec = {**base_record(cfg, mode, ctx), "error": _short(exc)}
            yield rec
    finally:
        del refs, inputs
        free_memory()


def cuda_healthy() -> bool:
    """False once the CUDA context is broken (a sticky error such as an illegal access)."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception:  # any failure here means later configs cannot run
        return False
    return True


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize() -> None:
    """Wait for the GPU (no-op where CUDA was never used), so errors surface here."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- cold start

COLD_CHILD = "import sys; from fastla.bench.runner import cold_child; sys.exit(cold_child(sys.argv[1:]))"


def cold_child(argv: Sequence[str]) -> int:
    """Subprocess body: build the inputs, then time the first fastla call (``fwdbwd``:
    forward and backward) up to ``torch.cuda.synchronize()``; prints ``{"cold_s": ...}``."""
    name, mode, seed = argv
    cfg = get_config(name)
    inputs = make_inputs(cfg, "cuda", int(seed))
    fn = make_fn("fastla", cfg, inputs, mode)
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(json.dumps({"cold_s": time.perf_counter() - start}))
    return 0


def run_cold(name: str, mode: str, seed: int, timeout: float) -> dict[str, Any]:
    """Run :func:`cold_child` in a fresh interpreter with an empty Triton cache."""
    with tempfile.TemporaryDirectory(prefix="fastla-cold-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        start = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, "-c", COLD_CHILD, name, mode, str(seed)],
                                 capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"cold_s": None, "cold_note": f"timed out after {timeout:.0f} s"}
        total = time.perf_counter() - start
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"cold_s": None, "cold_note": f"exit {out.returncode}: {tail[:240]}"}
    return {"cold_s": json.loads(lines[-1])["cold_s"], "cold_process_s": total}


def cold_targets(records: Sequence[Record], every: bool) -> list[tuple[str, str]]:
    """(config, mode) pairs still to cold-start: every record, or the first per (op, mode)
    when no record of that (op, mode) has a cold start yet."""
    def key(rec: Record) -> tuple[str, str]:
        return (rec["config"], rec["mode"]) if every else (rec["op"], rec["mode"])

    seen = {key(r) for r in records if r.get("cold_s") is not None}
    out = []
    for rec in records:
        if rec.get("fastla_error") or rec.get("error") or key(rec) in seen:
            continue
        seen.add(key(rec))
        out.append((rec["config"], rec["mode"]))
    return out


def measure_cold(targets: Sequence[tuple[str, str]], seed: int, jobs: int,
                 timeout: float) -> dict[tuple[str, str], dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {t: pool.submit(run_cold, t[0], t[1], seed, timeout) for t in targets}
        return {t: f.result() for t, f in futures.items()}


# ----------------------------------------------------------------------------- output

def _jsonable(x: Any) -> Any:
    """Non-finite floats become strings ("nan", "inf"): the file stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


class ResultFile:
    """The JSON result file, rewritten (atomically) after every record."""

    def __init__(self, path: Path, meta: dict[str, Any], records: list[Record] | None = None):
        self.path, self.meta = path, meta
        self.records: list[Record] = list(records or [])

    @classmethod
    def resume(cls, path: Path, meta: dict[str, Any]) -> "ResultFile":
        data = json.loads(path.read_text())
        return cls(path, meta, data.get("records", []))

    def done(self) -> set[tuple[str, str]]:
        return {(r["config"], r["mode"]) for r in self.records}

    def add(self, rec: Record) -> None:
        self.records.append(rec)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(_jsonable({"metadata": self.meta, "records": self.records}), indent=1))
        os.replace(tmp, self.path)


def default_path(out: str | None, gpu: str) -> Path:
    folder = Path(out) if out else REPO_ROOT / "benchmarks" / "results"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return folder / f"{gpu_slug(gpu)}-{stamp}.json"


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, stream: Any = None, width: int = 24):
        self.total, self.width, self.count = max(total, 1), width, 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()

    def _bar(self, label: str) -> str:
        filled = int(self.width * self.count / self.total)
        elapsed = time.monotonic() - self.start
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {self.count}/{self.total} {elapsed:5.0f}s {label}"

    def show(self, label: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self._bar(label))
            self.stream.flush()

    def advance(self, line: str, n: int = 1) -> None:
        self.count += n
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"{self._bar('')}\n  {line}\n" if not self.tty else f"{line}\n")
        self.stream.flush()


def _speed_text(rec: Record) -> str:
    if isinstance(rec.get("ratio"), float):
        return f"x{rec['ratio']:.2f}"
    return f"speedup refused ({rec['ratio_note']})" if rec.get("ratio_note") else "no speedup"


def summary_line(rec: Record) -> str:
    """One line per finished record for the progress log."""
    def ms(x: Any) -> str:
        return "-" if x is None else f"{x:.4f}"

    err = rec.get("fastla_rel_err")
    err_text = "-" if err is None else f"{err:.1e}"
    problem = rec.get("error") or rec.get("fastla_error") or rec.get("fla_error")
    tail = f" | error: {problem}" if problem else ""
    return (f"{rec['config']} {rec['mode']}: fastla {ms(rec.get('fastla_ms'))} ms, FLA {ms(rec.get('fla_ms'))} ms "
            f"({rec.get('timing')}), {_speed_text(rec)}, rel err {err_text}{tail}")


# ----------------------------------------------------------------------------- main

def run(args: argparse.Namespace, selected: list[tuple[BenchConfig, tuple[str, ...]]]) -> int:
    started = time.monotonic()
    fla, fla_reason = (None, "--no-fla") if args.no_fla else fla_version()
    meta = collect_metadata(fla)
    if args.append:
        results = ResultFile.resume(Path(args.append), meta)
    else:
        results = ResultFile(default_path(args.out, meta["gpu"]), meta)
    ctx = RunContext(timing_from_args(args), meta, fla is not None, fla_reason, not args.no_graph, args.max_rel_err)
    done = results.done()
    progress = Progress(sum(len(m) for _, m in selected))
    print(f"fastla bench: {len(selected)} configs -> {results.path}", file=sys.stderr)

    def out_of_time() -> bool:
        return args.time_limit_s is not None and time.monotonic() - started > args.time_limit_s

    for cfg, modes in selected:
        todo = [m for m in modes if (cfg.name, m) not in done]
        if len(todo) < len(modes):
            progress.advance(f"{cfg.name}: {len(modes) - len(todo)} record(s) already in the file",
                             len(modes) - len(todo))
        if not todo:
            continue
        if out_of_time():
            print(f"fastla bench: --time-limit-s reached; continue with --append {results.path}", file=sys.stderr)
            break
        progress.show(f"{cfg.name} {'/'.join(todo)}")
        for rec in bench_config(ctx, cfg, todo, args.seed):
            results.add(rec)
            progress.advance(summary_line(rec))
        if not cuda_healthy():
            print(f"fastla bench: the CUDA context broke during {cfg.name}; stopping "
                  f"(rerun with --append {results.path} to continue in a fresh process)", file=sys.stderr)
            finish(results)
            return 1
    if not args.no_cold and not out_of_time():
        add_cold_starts(results, args)
    finish(results)
    return 0


def add_cold_starts(results: ResultFile, args: argparse.Namespace) -> None:
    targets = cold_targets(results.records, args.cold_all)
    if not targets:
        return
    print(f"cold starts: {len(targets)} subprocess(es), {args.cold_jobs} at a time", file=sys.stderr)
    cold = measure_cold(targets, args.seed, args.cold_jobs, args.cold_timeout)
    for rec in results.records:
        info = cold.get((rec["config"], rec["mode"]))
        if info is not None:
            rec.update(info)
    results.write()


def finish(results: ResultFile) -> None:
    from fastla.bench.report import render_markdown, write_report

    md_path, png_path = write_report(results.records, results.path.with_suffix(""))
    print(render_markdown(results.records))
    print(f"wrote {results.path}, {md_path}" + (f", {png_path}" if png_path else " (plot skipped: no matplotlib)"),
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastla bench``; returns the process exit code."""
    args = parse_args(argv)
    if args.tier:
        os.environ["FASTLA_BACKEND"] = args.tier
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        print(f"fastla bench: {exc}", file=sys.stderr)
        return 2
    selected = select_configs(CONFIGS, args.filter, modes)
    if args.list:
        for cfg, run_modes in selected:
            print(f"{cfg.name:34s} {','.join(run_modes):12s} {cfg.describe()}")
        return 0
    if not selected:
        print(f"fastla bench: no config matches --filter {args.filter!r} and --modes {args.modes!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fastla bench: needs a CUDA GPU and torch.cuda.is_available() is False here; "
              "nothing was run (use --list to see the configs).", file=sys.stderr)
        return 2
    return run(args, selected)


if __name__ == "__main__":
    sys.exit(main())
