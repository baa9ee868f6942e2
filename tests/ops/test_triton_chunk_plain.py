"""The Triton chunked forward of the plain rule (GLA, Simple GLA, Lightning: the scan without the
delta correction) against the fp64 reference, through the public ops; on the CPU it runs in the
Triton interpreter."""
import pytest
import torch

from fastla.backends.triton import chunk_delta, interpreting
from fastla.core.dispatch import use_tier
from fastla.core.validation import build_problem
from tests.helpers import (
    KERNEL_DEVICES, OPS, assert_close, call_chunk, call_reference, make_inputs, poison, strided_inputs,
)

TOL = 2e-5 if interpreting() else 1e-2
GLA, SIMPLE, LIGHTNING = OPS["gla"], OPS["simple_gla"], OPS["lightning"]
SPECS = dict(argnames="spec", argvalues=[GLA, SIMPLE, LIGHTNING], ids=["gla", "simple_gla", "lightning"])


def check(spec, t, tol=TOL, tier="triton", **opts):
    with use_tier(tier, strict=True), torch.no_grad():
        o, ht = call_chunk(spec, t, output_final_state=True, **opts)
    opts.pop("cu_seqlens_cpu", None)
    if t["q"].dtype != torch.float32:
        t = {n: x.double() for n, x in t.items()}
    ro, rht = call_reference(spec, t, output_final_state=True, **opts)
    assert_close("o", o, ro, tol)
    assert_close("final_state", ht, rht, tol)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 130])
@pytest.mark.parametrize(**SPECS)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_lengths(spec, T, device):
    check(spec, make_inputs(spec, B=2, T=T, H=3, K=32, V=32, device=device))


@pytest.mark.parametrize("gates", ["g", "g_gamma", "both", "none"])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_simple_gla_gates(gates, device):
    """g per token, the constant g_gamma, their sum, or no decay at all."""
    t = make_inputs(SIMPLE, B=1, T=100, H=2, K=32, V=16, device=device)
    if gates in ("g_gamma", "none"):
        t.pop("g")
    if gates in ("g_gamma", "both"):
        t["g_gamma"] = -torch.rand(2, device=device) * 0.2
    check(SIMPLE, t)


@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 130, 7], [200]])
@pytest.mark.parametrize(**SPECS)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_varlen(spec, lengths, device):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(spec, B=1, T=sum(lengths), H=2, K=32, V=16, N=len(lengths), device=device)
    check(spec, t, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_state_layouts_and_no_initial_state(v_first, device):
    def inputs(spec, **kw):
        return make_inputs(spec, B=2, T=70, H=2, K=32, V=48, device=device, **kw)
    check(SIMPLE, inputs(SIMPLE, v_first=v_first), state_v_first=v_first)
    check(GLA, inputs(GLA, v_first=v_first), state_v_first=v_first)
    check(LIGHTNING, inputs(LIGHTNING, h0=False))


@pytest.mark.parametrize("K,V", [(64, 64), (128, 128)])
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_head_dims(K, V, device):
    check(SIMPLE, make_inputs(SIMPLE, B=1, T=70, H=1, K=K, V=V, device=device))
    check(GLA, make_inputs(GLA, B=1, T=70, H=1, K=K, V=V, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_segments(device, monkeypatch):
    """Sequence parallelism (segment summaries, the combine, the replays) with the plain rule:
    the summary's identity columns carry its transition e^(G_last) I."""
    monkeypatch.setattr(chunk_delta, "default_config",
                        lambda p, segment_gain=None: chunk_delta.ChunkConfig(segment_chunks=1))
    lengths = [200, 64, 3]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    for spec in (GLA, SIMPLE, LIGHTNING):
        t = make_inputs(spec, B=1, T=sum(lengths), H=2, K=32, V=32, N=len(lengths), device=device)
        check(spec, t, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
        check(spec, make_inputs(spec, B=2, T=150, H=2, K=32, V=32, device=device))


@pytest.mark.parametrize(**SPECS)
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strided_inputs(spec, device):
    """Strided views (q, k, v, the gates, g_gamma, the state) give the contiguous inputs' results."""
    lengths = [70, 1, 59]
    t = make_inputs(spec, B=1, T=sum(lengths), H=2, K=32, V=32, N=len(lengths), device=device)
    if spec is SIMPLE:
        t["g_gamma"] = -torch.rand(2, device=device) * 0.1
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    opts = dict(output_final_state=True, cu_seqlens=cu.to(device), cu_seqlens_cpu=cu)
    with use_tier("triton", strict=True), torch.no_grad():
        want = call_chunk(spec, t, **opts)
        got = call_chunk(spec, strided_inputs(t), **opts)
    for name, a, b in zip(("o", "final_state"), got, want):
        assert torch.equal(a, b), f"{name} differs with strided inputs"


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_strong_decay(device):
    """Decay to ~e^-2000 within a chunk: no inf or NaN (GLA's diagonal blocks past the span limit
    take the exact pairwise sums)."""
    check(SIMPLE, make_inputs(SIMPLE, B=1, T=130, H=2, K=32, V=32, strength=30.0, device=device))
    check(GLA, make_inputs(GLA, B=1, T=130, H=2, K=32, V=32, strength=30.0, device=device))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_a_decay_that_requires_grad_goes_to_the_torch_tier(device):
    """g_gamma requiring grad: the kernel tiers have no backward, so they pass the call on."""
    t = make_inputs(SIMPLE, B=1, T=8, H=2, K=16, V=16, device=device)
    g_gamma = (-torch.rand(2, device=device)).requires_grad_()
    p = build_problem("chunk_simple_gla", q=t["q"], k=t["k"], v=t["v"], g_gamma=g_gamma, delta=False, gva=False)
    assert "require grad" in chunk_delta.supports(p)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_gates_per_value_channel_go_to_the_next_tier(device):
    """A per-value-channel gate is not on this tier: it says so (the torch tier serves it)."""
    t = make_inputs(GLA, B=1, T=8, H=1, K=16, V=16, device=device)
    p = build_problem("chunk_gla", q=t["q"], k=t["k"], v=t["v"], gk=t["g"], gv=-torch.rand(1, 8, 1, 16, device=device),
                      delta=False, gva=False)
    assert chunk_delta.supports(p) == "per-value-channel gates (gv)"
    p = build_problem("chunk_gla", q=t["q"], k=t["k"], v=t["v"], gk=t["g"], delta=False, gva=False)
    assert chunk_delta.supports(p) is None


sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tier", ["triton", pytest.param("gluon", marks=pytest.mark.skipif(not sm90, reason="sm_90"))])
@pytest.mark.parametrize(**SPECS)
@pytest.mark.parametrize("shape", ["dense", "varlen", "segments", "k64"])
def test_bf16_wide_heads_gpu(tier, spec, shape, monkeypatch):
    """bf16 products at K = V = 128 (K = V = 64: ``k64``) on both kernel tiers against fp64, dense,
    varlen and split into segments (the Gluon tier: its sm_90 scans without the delta correction,
    the summaries on the two-chain scan); the allocator's free blocks poisoned with NaN first, and a
    second run bit-identical."""
    if shape == "segments":
        monkeypatch.setattr(chunk_delta, "default_config",
                            lambda p, segment_gain=None: chunk_delta.ChunkConfig(segment_chunks=2))
    lengths = [700, 1, 64, 300]
    B, T, N = (1, sum(lengths), len(lengths)) if shape in ("varlen", "segments") else (2, 1000, 2)
    D = 64 if shape == "k64" else 128
    t = make_inputs(spec, B=B, T=T, H=4, K=D, V=D, N=N, dtype=torch.bfloat16, device="cuda")
    opts = {}
    if B == 1:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        opts = dict(cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu)
    runs = []
    for _ in range(2):
        poison()
        with use_tier(tier, strict=True), torch.no_grad():
            runs.append(call_chunk(spec, t, output_final_state=True, **opts))
    for a, b in zip(*runs):
        assert torch.equal(a, b), "a second run differs (a race?)"
    check(spec, t, tol=1e-2, tier=tier, **opts)
