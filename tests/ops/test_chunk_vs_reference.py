"""Each op's chunked tier against the fp64 token-by-token reference: output, final state
and every gradient through the public autograd API, loss (o*do).sum() + (ht*dht).sum()."""
import pytest
import torch

from fastla.backends.triton import chunk_training, interpreting
from tests.helpers import (
    DEVICES, OPS, TOLERANCE, as_leaves, assert_close, call_chunk, call_reference, forward_backward, make_inputs,
    random_final_state_grad,
)


@pytest.fixture(autouse=True)
def _training_on_the_torch_tier_in_the_interpreter(monkeypatch):
    """In the Triton interpreter (no GPU) the gradients here come from the torch tier's autograd:
    the Triton backward (on by default for GDN and KDA) takes ~6 min of this file's CPU time
    interpreted, and its interpreter checks live in test_triton_chunk_backward.py (GVA, varlen,
    every option). On a GPU the default serves."""
    if interpreting():
        monkeypatch.setattr(chunk_training, "ENABLED", False)


def check_against_reference(spec, t, device="cpu", fast_only=None, with_dht=True, **opts):
    """``opts`` go to both sides, ``fast_only`` to the op under test only; ``with_dht`` False: the
    final state is returned but left out of the loss (its gradient None)."""
    dtype = t["q"].dtype
    tol_o, tol_g = TOLERANCE[dtype]
    leaves = as_leaves(t)
    o_shape = t["v"].shape
    do = torch.randn(o_shape, device=device)
    N = t["initial_state"].shape[0] if "initial_state" in t else None
    fast = lambda x, **kw: call_chunk(spec, x, output_final_state=True, **kw, **(fast_only or {}))  # noqa: E731
    dht = random_final_state_grad(t, **opts) if with_dht else None
    o, ht, grads = forward_backward(fast, leaves, do, dht, **opts)
    ref_leaves = as_leaves(t, torch.float64)
    ref = lambda x, **kw: call_reference(spec, x, output_final_state=True, **kw)  # noqa: E731
    ro, rht, rgrads = forward_backward(ref, ref_leaves, do, dht, **opts)
    assert o.dtype == t["v"].dtype and ht.dtype == torch.float32
    if N is not None:
        assert ht.shape[0] == N
    assert_close("o", o, ro, tol_o)
    assert_close("final_state", ht, rht, tol_o)
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        assert_close(f"d{name}", g, rgrads[name], tol_g)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_lengths(op, T):
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=2, T=T, H=2, K=32, V=32))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_and_devices(op, dtype, device):
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=2, T=130, H=2, K=32, V=32, dtype=dtype, device=device), device)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("K,V", [(64, 64), (128, 128), (32, 48)])
def test_head_dims(op, K, V):
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=1, T=100, H=1, K=K, V=V))


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_gva(op, ratio):
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=2, T=70, H=2, HV=2 * ratio, K=32, V=32))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("strength", [1e-3, 1.0, 30.0])
def test_decay_strength(op, strength):
    """Near-zero decay (gate ~ 0) and strong decay (exp(G) underflows in a chunk): no inf/NaN."""
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=1, T=140, H=2, K=32, V=32, strength=strength))


@pytest.mark.parametrize("op", list(OPS))
def test_state_v_first(op):
    spec = OPS[op]
    t = make_inputs(spec, B=2, T=70, H=2, K=32, V=16, v_first=True)
    check_against_reference(spec, t, state_v_first=True)


@pytest.mark.parametrize("op", list(OPS))
def test_final_state_out_of_the_loss(op):
    """The final state returned but unused: its gradient None into the backward."""
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=2, T=70, H=2, K=32, V=32), with_dht=False)


@pytest.mark.parametrize("op", list(OPS))
def test_no_initial_state(op):
    spec = OPS[op]
    check_against_reference(spec, make_inputs(spec, B=2, T=70, H=2, K=32, V=32, h0=False))


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 130, 7], [300, 1], [1]])
def test_varlen(op, lengths):
    spec = OPS[op]
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    t = make_inputs(spec, B=1, T=T, H=2, HV=4 if spec.gva else None, K=32, V=32, N=len(lengths))
    check_against_reference(spec, t, cu_seqlens=cu)
