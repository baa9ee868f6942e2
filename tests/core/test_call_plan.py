"""Call plans (fastla/core/call_plan.py): the signature separates what the full path depends on,
a replay issues the full path's launches, and what cannot be replayed is not planned."""
import os
import subprocess
import sys

import pytest
import torch

from fastla.core import call_plan
from fastla.core.dispatch import use_tier
from tests.helpers import gpu


def _sig(*args, **kwargs):
    return call_plan._signature(args, kwargs)


def test_signature_separates_what_the_host_path_reads(monkeypatch):
    monkeypatch.setattr(call_plan, "_on_device", lambda x: x.is_floating_point())
    q = torch.zeros(1, 64, 2, 32)
    cu = torch.tensor([0, 30, 64])
    base = _sig(q, scale=0.5, cu_seqlens_cpu=cu)
    assert base == _sig(torch.ones(1, 64, 2, 32), scale=0.5, cu_seqlens_cpu=cu.clone())
    different = [
        _sig(torch.zeros(1, 65, 2, 32), scale=0.5, cu_seqlens_cpu=cu),                   # shape
        _sig(torch.zeros(1, 64, 2, 32, dtype=torch.bfloat16), scale=0.5, cu_seqlens_cpu=cu),  # dtype
        _sig(torch.zeros(1, 2, 64, 32).transpose(1, 2), scale=0.5, cu_seqlens_cpu=cu),   # strides
        _sig(torch.zeros(1, 64 * 2 * 32 + 1)[:, 1:].view(1, 64, 2, 32), scale=0.5, cu_seqlens_cpu=cu),  # alignment
        _sig(q, scale=0.25, cu_seqlens_cpu=cu),                                          # a number
        _sig(q, scale=1, cu_seqlens_cpu=cu),                                             # its type
        _sig(q, scale=0.5, cu_seqlens_cpu=torch.tensor([0, 31, 64])),                    # host values
        _sig(q, 0.5, cu_seqlens_cpu=cu),                                                 # positional
    ]
    with use_tier("torch"):
        different.append(_sig(q, scale=0.5, cu_seqlens_cpu=cu))                         # a forced tier
    with torch.no_grad():
        different.append(_sig(q, scale=0.5, cu_seqlens_cpu=cu))                         # grad mode
    assert len({base, *different}) == len(different) + 1


@pytest.mark.parametrize("arg", [object(), [1, 2], torch.zeros(2, requires_grad=True), torch.zeros(5000, dtype=torch.int32)])
def test_signature_refuses_what_it_cannot_key(arg, monkeypatch):
    monkeypatch.setattr(call_plan, "_on_device", lambda x: x.is_floating_point())
    _sig(torch.zeros(2), 3)
    with pytest.raises(call_plan._Unplanned):
        _sig(torch.zeros(2), arg)


def test_calls_without_device_tensors_are_not_planned():
    with pytest.raises(call_plan._Unplanned):
        _sig(torch.zeros(2), cu_seqlens_cpu=torch.tensor([0, 2]))


def test_recording_flags_device_data_and_unknown_tensors(monkeypatch):
    """A call whose host path computes on device data, or launches nothing, is not planned, and
    calls with its signature take the full path."""
    monkeypatch.setattr(call_plan, "ENABLED", True)
    monkeypatch.setattr(call_plan, "_on_device", lambda x: x.is_floating_point())
    calls = []

    @call_plan.planned
    def reads_values(x):
        calls.append(1)
        return x.sum()

    x = torch.ones(4)
    reads_values(x)
    assert reads_values.plan_of(x) is None                  # seen once: noted, not recorded
    reads_values(x)
    assert "aten op" in reads_values.plan_of(x)
    reads_values(torch.ones(4))
    assert len(calls) == 3


def test_replays_match_the_full_path():
    """fastla/bench/host_stub.py in a process without the Triton interpreter: for GDN and KDA
    (both tiers: plain, state layouts, varlen with the gate in the op, segments with chunk
    states, KDA's gates and its gated keys formed in the scan), GLA, Simple GLA and Lightning (both tiers) and decode, the replayed launches (kernels, grids, every argument, the
    buffers named) and result equal the full path's, strided inputs are copied before the replayed
    launches (their dense copies hold the call's values); fp16 inputs (cast first) are not planned."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "fastla.bench.host_stub"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all replays match" in run.stdout


@gpu
@pytest.mark.parametrize("case", ["gdn", "gdn-split", "gdn-varlen", "kda", "kda-varlen", "gdn-decode", "gdn-pool",
                                  "gdn-stream-pool", "gdn-varlen-strided", "kda-strided", "gdn-pipelined",
                                  "kda-gates-in-scan"])
def test_replay_equals_full_path_on_gpu(case, monkeypatch):
    """On the GPU: a replayed call's output and final state (or pool) equal the full path's bit for
    bit (same kernels, same inputs); the outputs are poisoned first. The strided cases build their
    views on the GPU (``.cuda()`` of a view with gaps is contiguous)."""
    from fastla.bench.host_stub import cases, split_views

    named = {name: (op, make, tier) for name, op, make, tier, _ in cases()}
    key = {"gdn": "gdn-gluon", "gdn-split": "gdn-gluon-split-states", "gdn-varlen": "gdn-gluon-varlen-gate",
           "kda": "kda-gluon-safe-gate", "kda-varlen": "kda-gluon-given-gate-varlen", "gdn-decode": "gdn-decode",
           "gdn-pool": "gdn-verify-pool", "gdn-stream-pool": "gdn-decode-bf16-pool",
           "gdn-varlen-strided": "gdn-gluon-varlen-gate", "kda-strided": "kda-gluon-safe-gate",
           "gdn-pipelined": "gdn-gluon-pipelined", "kda-gates-in-scan": "kda-gluon-gates-in-scan"}[case]
    op, make, _ = named[key]

    def on_gpu(kw):
        kw = {n: (x.cuda() if isinstance(x, torch.Tensor) and n != "cu_seqlens_cpu" else x) for n, x in kw.items()}
        return split_views(kw) if case.endswith("strided") else kw

    x, y = on_gpu(make(0)), on_gpu(make(1))
    with torch.no_grad():
        full = op(**on_gpu(make(0)))                # a copy of x: a pool is updated in place
        monkeypatch.setattr(call_plan, "ENABLED", True)
        op(**on_gpu(make(1)))                       # noted
        op(**y)                                     # recorded
        plan = op.plan_of(**y)
        assert plan is not None and not isinstance(plan, str), plan
        poison = [torch.full((1 << 22,), float("nan"), device="cuda") for _ in range(8)]
        del poison                                  # the replay's buffers come from this memory
        replay = op(**x)
    for i, (a, b) in enumerate(zip(full, replay)):
        if a is not None:
            assert not a.isnan().any(), f"output {i} of the full path has NaN"
            both = a.isfinite() & b.isfinite()
            assert torch.equal(a, b), (f"output {i} {list(a.shape)}: {int((~b.isfinite()).sum())} non-finite in the "
                                       f"replay at {(~b.isfinite()).nonzero()[:4].tolist()}, max difference where "
                                       f"finite {float((a - b)[both].abs().max()) if both.any() else 0}")
