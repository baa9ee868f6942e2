"""A chunked call's kernels compiled side by side on its first call (cold start).

Issues 3 and 4 ask for a first call (fresh process, empty Triton cache) under 10 s. Most of that
time is compiling. A chunked call launches three to seven kernels, and each launch compiles its
kernel on first use, one after another. Triton's compiles do not hold the GIL (MLIR passes, LLVM,
ptxas), so they can run side by side on threads: on the 2-core CPU machine, KDA's first call with
the softplus gate took 6.8 s of sm_90 compiles in a row and 4.8 s side by side, GDN's 2.7 and 1.7 s
(``benchmarks/compile_times.py --ahead off,on``; docs/notes/gdn-prefill.md, v25).

How. The first call of a class of calls (below) on the GPU tiers runs the tier's host code twice:
- a dry pass: every launch becomes ``JITFunction.run(..., warmup=True)`` under Triton's
  ``AsyncCompileMode``, which submits the compile to a thread pool and launches nothing (each worker
  then builds the kernel's C launcher too, which Triton would otherwise compile with gcc at the first
  launch); the pass ends when every compile has finished;
- the real pass, whose launches find their kernels compiled.
The dry pass launches no kernel, but the torch ops of the host code run (allocations, the dense
copies of strided inputs, casts) on buffers that no kernel filled; the chunked paths read no kernel
output on the host and index nothing with one (a device-side assert would need that). An error in the
dry pass is left to the real pass, which raises it (or compiles what the dry pass could not).

A class: the op, the tier, the device, the head counts and dimensions, the options, the dtypes and
whether each tensor is given; B, T and N by their bit length, whether they are 1 and whether 16
divides them. It approximates what decides the kernels, no more: a call of a class seen before
takes the real pass alone, and compiles what it needs that the class's first call did not (a split
into segments, say) at its launches, one after another, as without compile ahead; a call whose
class is new but whose kernels are compiled pays one more run of the host code (~0.2 ms). Skipped: the torch tier, CPU
tensors, the interpreter, CUDA-graph capture, ``torch.compile`` tracing, call-plan recordings,
Triton's launch hooks, and another ``AsyncCompileMode`` in force. Off by default until it has run
on a GPU: ``FASTLA_COMPILE_AHEAD=1`` (or ``ENABLED = True``) turns it on.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger("fastla")

# off until it has run on a GPU (docs/notes/gdn-prefill.md v25: its GPU test and the cold starts
# with it off and on, benchmarks/gpu_checks.sh tests and cold-gates)
ENABLED = os.environ.get("FASTLA_COMPILE_AHEAD", "0") == "1"
THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
_SEEN: set = set()
_local = threading.local()
_pool: ThreadPoolExecutor | None = None


def dry() -> bool:
    """Whether this thread is in a dry pass (``Launcher.launch`` then submits compiles only)."""
    return getattr(_local, "dry", False)


def before(op: str, tier: str, run, problem) -> None:
    """Called by the dispatcher before ``run(problem)`` serves a call: on the first call of its
    class, the dry pass (above)."""
    if not ENABLED or tier == "torch" or not op.startswith("chunk_"):
        return
    key = _class_of(op, tier, problem)
    if key in _SEEN or not _eligible(problem):
        return
    from triton.runtime import _async_compile

    if _async_compile.active_mode.get() is not None:      # the caller's own: its compiles, its rules
        return
    _SEEN.add(key)
    mode = _async_compile.AsyncCompileMode(_executor(), ignore_errors=True)
    mode.__enter__()
    try:
        _local.dry = True
        try:
            run(problem)
        except Exception as exc:        # the real pass raises it again, or runs what this one could not
            logger.debug("fastla: the dry pass of a first %s call stopped (%s: %s)", op, type(exc).__name__, exc)
        finally:
            _local.dry = False
        mode.__exit__(None, None, None)         # waits for the compiles; the kernels enter Triton's caches
    finally:                            # (Triton's __exit__ does not reset the mode if the wait is interrupted)
        _async_compile.active_mode.set(None)


def clear() -> None:
    """Forget the classes seen (the next call of each runs a dry pass again)."""
    _SEEN.clear()


def _eligible(problem) -> bool:
    from fastla.backends.triton import launch
    from fastla.core import call_plan

    if not call_plan._on_device(problem.q) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if call_plan.recording() is not None or torch.compiler.is_compiling() or launch.hooks_active():
        return False
    return not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())


def _class_of(op: str, tier: str, p) -> tuple:
    """The class of a call (above). Every field of ``Problem`` enters it but ``scale`` (a runtime
    value of every kernel), the host offsets (through N) and the pool (chunked calls have none);
    tests/core/test_compile_ahead.py checks that. Also: whether T spans more than one chunk (the
    kernels' length-specialized twins, launch.py), whether ``lower_bound`` is within safe_gate's
    range (KDA's bounded spans) and the device."""
    return (op, tier, p.q.get_device(), p.q.dtype, p.k.dtype, p.v.dtype, p.o_dtype, _dtype(p.g), _dtype(p.gk),
            _dtype(p.gv), _dtype(p.g_gamma), _dtype(p.beta), _dtype(p.A_log), _dtype(p.dt_bias),
            _dtype(p.initial_state), _dtype(p.cu_seqlens), p.delta, p.gate_in_op,
            None if p.lower_bound is None else p.lower_bound >= -5, p.use_qk_l2norm, p.beta_sigmoid,
            p.allow_neg_eigval, p.output_final_state, p.state_v_first, p.reverse, p.chunk_size,
            p.return_intermediate_states, p.H, p.HV, p.K, p.V, _size(p.B), _size(p.T), p.T > p.chunk_size,
            _size(p.N))


def _dtype(x):
    return None if x is None else x.dtype


def _size(n: int) -> tuple:
    return n == 1, n & 15 == 0, n.bit_length()


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = _CompileThenLauncher(max_workers=THREADS, thread_name_prefix="fastla-compile")
    return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads do not exist there (a new pool starts on use)."""
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


class _CompileThenLauncher(ThreadPoolExecutor):
    """Runs each submitted compile, then builds the compiled kernel's C launcher (Triton compiles it
    with gcc at a kernel's first launch, unless its disk cache has it: ~0.2 s each on the CPU
    machine)."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(_compile_then_launcher, fn, args, kwargs)


def _compile_then_launcher(compile_fn, args, kwargs):
    kernel = compile_fn(*args, **kwargs)
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(kernel.src, kernel.metadata)    # fills the disk cache; the object is dropped
    except Exception as exc:            # the first launch builds it again and raises there
        logger.debug("fastla: building the launcher of %s ahead failed (%s)", kernel.name, exc)
    return kernel
