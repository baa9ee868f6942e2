"""pytest configuration: the Triton interpreter where there is no GPU, one intra-op thread (the test tensors are tiny; spinning thread pools
only contend on a busy 2-core machine), per-test seeds derived from the test id, out-of-bounds accesses caught in the interpreter
(tests/interpreter_bounds.py), and how many
workers the README's `-n auto` starts."""
import os
import zlib

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (must be set before triton kernels are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("FASTLA_BOUNDS_CHECK", "1") != "0":
    from tests import interpreter_bounds

    interpreter_bounds.install()        # every kernel's loads and stores inside its tensors


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest-xdist): without a GPU, one worker per core this process may use, at most
    8 (the interpreter's tests are single-threaded and independent); with a GPU, none: the tests run
    in this process, one after another, because the GPU tests share one card and some take 50 GB of it."""
    if torch.cuda.is_available():
        return 0
    return min(len(os.sched_getaffinity(0)), 8)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def _no_call_plans(monkeypatch):
    """Call plans (fastla/core/call_plan.py) off: tests patch plan choices between calls of one
    signature; tests/core/test_call_plan.py turns them on where it checks them."""
    from fastla.core import call_plan

    monkeypatch.setattr(call_plan, "ENABLED", False)
    call_plan.clear()
    yield
    call_plan.clear()
