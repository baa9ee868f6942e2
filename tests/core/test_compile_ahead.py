"""fastla/core/compile_ahead.py: a chunked call's first call of its class compiles its kernels side
by side (a dry pass whose launches submit compiles and launch nothing), once per class.

The end-to-end check on real kernels (every chunked case of both GPU tiers, the submissions before
the first launch, the same kernels as without it) is ``python -m fastla.bench.host_stub``, run by
tests/core/test_call_plan.py; on the GPU, ``test_first_call_equals_later_calls_on_gpu`` below."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from fastla.backends.triton.launch import Launcher
from fastla.core import compile_ahead
from fastla.core.problem import Problem
from fastla.core.validation import build_problem
from tests.helpers import gpu

# fields of Problem that do not enter a class: what replaces them and why (compile_ahead._class_of)
NOT_IN_CLASS = {"op": "the op's name enters as the op argument", "scale": "a runtime value of every kernel",
                "cu_seqlens_host": "enters through N", "pool": "chunked calls have none"}


def _problem(T=200, N=1, **kw) -> Problem:
    gen = torch.Generator().manual_seed(0)
    H, HV, K, V = 2, 4, 64, 64
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    cu = torch.linspace(0, T, N + 1).long() if N > 1 else None
    return build_problem("chunk_gated_delta_rule", q=q, k=k, v=torch.randn(1, T, HV, V, generator=gen),
                         g=-torch.rand(1, T, HV, generator=gen), beta=torch.rand(1, T, HV, generator=gen),
                         delta=True, gva=True, cu_seqlens=cu, **kw)


def _changed(name: str, value):
    """Another value of a Problem field, of a kind that could change what the kernels compile."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return 2 * value + 1
    if isinstance(value, torch.dtype):
        return torch.float16 if value != torch.float16 else torch.float32
    if isinstance(value, torch.Tensor):
        return None if name not in ("q", "k", "v") else value.half()
    if name == "gate_in_op":
        return "kda" if value is None else None
    if name == "lower_bound":
        return -5.0 if value is None else None
    return torch.zeros(3)                               # None: a tensor given


def test_every_field_of_a_problem_enters_the_class_or_is_named():
    p = _problem()
    base = compile_ahead._class_of("chunk_gated_delta_rule", "gluon", p)
    for f in dataclasses.fields(Problem):
        if f.name in NOT_IN_CLASS:
            continue
        other = dataclasses.replace(p, **{f.name: _changed(f.name, getattr(p, f.name))})
        assert compile_ahead._class_of("chunk_gated_delta_rule", "gluon", other) != base, f.name
    assert compile_ahead._class_of("chunk_gated_delta_rule", "triton", p) != base


@pytest.mark.parametrize("T, other, same", [(8000, 8016, True), (8000, 8001, False), (8000, 16384, False),
                                             (1, 2, False), (4096, 5000, False)])
def test_lengths_enter_by_bit_length_divisibility_and_one(T, other, same):
    """Varlen batches of new lengths every call stay in a few classes: T, B and N enter by bit
    length, by whether 16 divides them and whether they are 1."""
    a = compile_ahead._class_of("chunk_kda", "gluon", dataclasses.replace(_problem(), T=T))
    b = compile_ahead._class_of("chunk_kda", "gluon", dataclasses.replace(_problem(), T=other))
    assert (a == b) == same


@pytest.mark.parametrize("field, a, b", [("T", 64, 80), ("lower_bound", -5.0, -6.0)])
def test_what_else_changes_the_kernels_enters_the_class(field, a, b):
    """One chunk or more (the length-specialized twins), a lower bound inside safe_gate's range or
    not (KDA's bounded spans)."""
    p = _problem()
    assert (compile_ahead._class_of("chunk_kda", "gluon", dataclasses.replace(p, **{field: a}))
            != compile_ahead._class_of("chunk_kda", "gluon", dataclasses.replace(p, **{field: b})))


class _Kernel:
    """A kernel's stand-in: records ``run`` calls (Launcher submits through them in a dry pass)."""

    params = ()

    def __init__(self):
        self.runs = []

    def run(self, *args, grid, warmup, **kwargs):
        from triton.runtime import _async_compile

        self.runs.append((args, grid, warmup, kwargs, _async_compile.active_mode.get() is not None))

    def __getitem__(self, grid):
        raise AssertionError("a dry pass launched a kernel")


@pytest.fixture
def eligible(monkeypatch):
    """compile_ahead as on a GPU host: calls eligible, no class seen."""
    monkeypatch.setattr(compile_ahead, "_eligible", lambda problem: True)
    monkeypatch.setattr(compile_ahead, "ENABLED", True)
    compile_ahead.clear()
    yield
    compile_ahead.clear()


def test_first_call_of_a_class_submits_its_compiles_and_launches_nothing(eligible):
    kernel = _Kernel()
    passes = []

    def run(problem):
        passes.append(compile_ahead.dry())
        Launcher(kernel)[(3, 1)](1, 2.0, BLOCK=64)

    p = _problem()
    compile_ahead.before("chunk_gated_delta_rule", "gluon", run, p)
    assert passes == [True] and not compile_ahead.dry()
    assert kernel.runs == [((1, 2.0), (3, 1), True, {"BLOCK": 64}, True)]    # warmup, AsyncCompileMode on
    compile_ahead.before("chunk_gated_delta_rule", "gluon", run, p)         # the class is seen
    compile_ahead.before("chunk_gated_delta_rule", "gluon", run, dataclasses.replace(p, T=201))
    assert passes == [True]
    compile_ahead.before("chunk_gated_delta_rule", "gluon", run, dataclasses.replace(p, HV=8))
    assert passes == [True, True]


def test_an_error_in_the_dry_pass_is_left_to_the_real_pass(eligible):
    def run(problem):
        raise ValueError("raised in the dry pass")

    compile_ahead.before("chunk_kda", "triton", run, _problem())       # no raise: the real pass will
    assert not compile_ahead.dry()


def test_an_interrupted_wait_leaves_no_compile_mode_behind(eligible):
    """Ctrl-C while the dry pass waits for its compiles: it propagates, and neither Triton's async
    compile mode nor the dry flag stays set on the thread."""
    from triton.runtime import _async_compile

    def interrupted():
        raise KeyboardInterrupt

    def run(problem):
        _async_compile.active_mode.get().submit("key", interrupted, lambda kernel: None)

    with pytest.raises(KeyboardInterrupt):
        compile_ahead.before("chunk_kda", "gluon", run, _problem())
    assert _async_compile.active_mode.get() is None and not compile_ahead.dry()


def test_no_dry_pass_under_the_callers_own_async_compile_mode(eligible):
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime import _async_compile

    with ThreadPoolExecutor(1) as pool, _async_compile.AsyncCompileMode(pool):
        compile_ahead.before("chunk_kda", "gluon", lambda problem: pytest.fail("a dry pass ran"), _problem())
    passes = []
    compile_ahead.before("chunk_kda", "gluon", passes.append, _problem())      # the class is not marked seen
    assert len(passes) == 1


@pytest.mark.parametrize("op, tier, enabled", [("chunk_kda", "torch", True),
                                               ("fused_recurrent_gated_delta_rule", "triton", True),
                                               ("chunk_kda", "gluon", False)])
def test_no_dry_pass_on_the_torch_tier_for_decode_or_when_off(eligible, monkeypatch, op, tier, enabled):
    monkeypatch.setattr(compile_ahead, "ENABLED", enabled)
    compile_ahead.before(op, tier, lambda problem: pytest.fail("a dry pass ran"), _problem())


def test_no_dry_pass_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(compile_ahead, "ENABLED", True)
    compile_ahead.clear()
    compile_ahead.before("chunk_kda", "triton", lambda problem: pytest.fail("a dry pass ran"), _problem())


_FIRST_CALL = """
import sys, torch
from fastla.bench.host_stub import cases
from fastla.core import call_plan, compile_ahead
from fastla.core.dispatch import use_tier
compile_ahead.ENABLED = sys.argv[1] == "on"
call_plan.ENABLED = False
named = {n: (op, make, tier) for n, op, make, tier, _ in cases()}
for name in sys.argv[2:]:
    op, make, tier = named[name]
    x = {k: v.cuda() if isinstance(v, torch.Tensor) and k != "cu_seqlens_cpu" else v for k, v in make(0).items()}
    with use_tier(tier, strict=True), torch.no_grad():
        first = op(**x)
        torch.cuda.synchronize()
        later = op(**x)
    for a, b in zip(first, later):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        assert a is None or not a.float().isnan().any(), name
print("first calls equal later calls:", ", ".join(sys.argv[2:]))
"""


@gpu
def test_first_call_equals_later_calls_on_gpu(tmp_path):
    """On the GPU, in a fresh process with an empty Triton cache: the first call of each case (its
    kernels compiled by the dry pass on threads, while its torch ops ran on unfilled buffers) gives
    the same output and final state as the later calls, bit for bit, and no NaN."""
    names = ["gdn-gluon-split-states", "kda-gluon-given-gate-varlen", "kda-gluon-safe-gate", "gdn-triton-varlen-gate",
             "gla-gluon-varlen"]
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", _FIRST_CALL, "on", *names], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "first calls equal later calls" in run.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_pool():
    """A child forked after the pool started does not inherit its (absent) threads."""
    from concurrent.futures import ThreadPoolExecutor

    ThreadPoolExecutor.submit(compile_ahead._executor(), lambda: None).result()     # (its threads started)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if compile_ahead._pool is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
