"""pytest configuration: the Triton interpreter where there is no GPU, one intra-op thread (the test tensors are tiny; spinning thread pools
only contend on a busy 2-core machine), and per-test seeds derived from the test id."""
import os
import zlib

import pytest
import torch

torch.set_num_threads(1)
if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter (must be set before triton kernels are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
