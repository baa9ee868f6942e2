"""torch.compile(fullgraph=True) over the decode ops: one custom op in the graph, the same
results as eager, the pool updated in place."""
import pytest
import torch

from fastla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from fastla.ops.kda import fused_recurrent_kda
from tests.helpers import OPS, make_inputs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_pool_decode_compiles_fullgraph(backend):
    torch._dynamo.reset()
    t = make_inputs(OPS["gdn"], B=3, T=1, H=2, HV=4, K=16, V=16, h0=False)
    pool = torch.randn(6, 4, 16, 16)
    idx = torch.tensor([4, -1, 1])

    def step(q, k, v, g, beta, pool, idx):
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool, ssm_state_indices=idx,
                                                use_qk_l2norm_in_kernel=True)[0]

    eager_pool = pool.clone()
    expect = step(t["q"], t["k"], t["v"], t["g"], t["beta"], eager_pool, idx)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = compiled(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, idx)
    assert torch.equal(got, expect)
    assert torch.equal(pool, eager_pool)


def test_final_state_decode_compiles_fullgraph():
    torch._dynamo.reset()
    t = make_inputs(OPS["kda"], B=2, T=3, H=2, K=16, V=16)

    def step(q, k, v, g, beta, initial_state):
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)

    o, ht = step(**t)
    co, cht = torch.compile(step, fullgraph=True, backend="aot_eager")(**t)
    assert torch.equal(co, o) and torch.equal(cht, ht)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_v_first_final_state_under_inductor(dtype):
    """The fake's shape, strides and dtype match the real op (a mismatch fails inductor's checks)."""
    from fastla.ops.gla import fused_recurrent_gla
    torch._dynamo.reset()
    t = make_inputs(OPS["gla"], B=2, T=3, H=2, K=16, V=8, h0=False, dtype=dtype)

    def step(q, k, v, g):
        o, ht = fused_recurrent_gla(q, k, v, gk=g, output_final_state=True, state_v_first=True)
        return o, ht + 1

    o, ht = step(**t)
    co, cht = torch.compile(step, fullgraph=True)(**t)
    assert cht.dtype == ht.dtype and torch.allclose(co, o) and torch.allclose(cht, ht)
