"""pytest configuration: each test draws its own inputs from a seed derived from its id."""
import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
