"""The dispatcher: FASTLA_BACKEND forces the first tier tried; a tier that cannot serve a
call logs its reason once and the next tier serves it."""
import logging

import pytest
import torch

from fastla.core import dispatch
from fastla.ops.gla import chunk_gla


def _call():
    """A call the kernel tiers do not serve (float64 inputs)."""
    x = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    return chunk_gla(x, x, x, -torch.rand(1, 8, 1, 4, dtype=torch.float64))


def test_torch_serves_on_cpu(monkeypatch):
    from fastla.core.validation import build_problem
    monkeypatch.delenv("FASTLA_BACKEND", raising=False)
    x = torch.randn(1, 8, 1, 4, dtype=torch.float64)
    problem = build_problem("chunk_gla", q=x, k=x, v=x, gk=-x.abs(), delta=False, gva=False)
    tiers = dict(dispatch.explain("chunk_gla", problem))
    assert tiers["torch"] is None
    assert dispatch.select("chunk_gla", problem)[0] == "torch"


def test_forced_tier_falls_through_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv("FASTLA_BACKEND", "triton")
    dispatch._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="fastla"):
        _call()
        _call()
    lines = [r.getMessage() for r in caplog.records if "triton tier cannot serve chunk_gla" in r.getMessage()]
    assert len(lines) == 1, lines


def test_bad_backend_name(monkeypatch):
    monkeypatch.setenv("FASTLA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FASTLA_BACKEND"):
        _call()


def test_use_tier_context():
    with dispatch.use_tier("torch"):
        assert dispatch.candidate_order() == ("torch",)
    with pytest.raises(ValueError):
        with dispatch.use_tier("cutlass"):
            pass
