"""torch.compile(fullgraph=True) over the decode ops: one custom op in the graph, the same
results as eager, the pool updated in place."""
import pytest
import torch

from fastla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from fastla.ops.kda import fused_recurrent_kda
from tests.helpers import OPS, call_chunk, gpu, make_inputs


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


def _fastla_ops(graphs) -> list:
    return [str(n.target) for gm in graphs for n in gm.graph.nodes
            if n.op == "call_function" and "fastla" in str(n.target)]


@pytest.mark.parametrize("op", ["gdn", "kda", "gla", "simple_gla", "lightning"])
def test_chunk_compiles_fullgraph_as_one_op(op):
    """A chunked forward under torch.compile(fullgraph=True) is one custom op (torch.ops.fastla.chunk)
    in the graph, with eager's results."""
    torch._dynamo.reset()
    spec = OPS[op]
    t = make_inputs(spec, B=2, T=70, H=2, K=16, V=16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(t):
        return call_chunk(spec, t, output_final_state=True)

    with torch.no_grad():
        o, ht = step(t)
        co, cht = torch.compile(step, fullgraph=True, backend=backend)(t)
    assert torch.equal(co, o) and torch.equal(cht, ht)
    assert _fastla_ops(graphs) == ["fastla.chunk"]


def test_chunk_options_compile_fullgraph():
    """Varlen offsets (device and host), the gates in the op with KDA's safe gate, the l2norm, beta
    sigmoid and the V-first state through the custom op (inductor), with eager's results."""
    torch._dynamo.reset()
    spec = OPS["kda"]
    lengths = [70, 1, 59]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t = make_inputs(spec, B=1, T=sum(lengths), H=2, HV=4, K=16, V=16, N=3, v_first=True)
    opts = dict(use_gate_in_kernel=True, A_log=torch.randn(4) * 0.5, dt_bias=torch.randn(4 * 16), safe_gate=True,
                lower_bound=-5.0, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                state_v_first=True, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu)

    def step(t, **kw):
        return call_chunk(spec, t, **opts, **kw)

    with torch.no_grad():
        want = step(t)
        got = torch.compile(step, fullgraph=True, backend="inductor")(t)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, want))


def test_chunk_calls_the_custom_op_only_where_it_can(monkeypatch):
    """While compiling (patched here, no tracing): the chunked op goes through torch.ops.fastla.chunk
    unless it returns the intermediate states (their count depends on the offsets' values), checks
    FLA's chunk_indices or needs gradients; each way the results are eager's."""
    from fastla.core import custom_ops

    spec = OPS["gdn"]
    cu = torch.tensor([0, 70, 71, 130])
    t = make_inputs(spec, B=1, T=130, H=2, HV=4, K=16, V=16, N=3)
    routed = []
    real = torch.ops.fastla.chunk
    monkeypatch.setattr(custom_ops.torch.ops.fastla, "chunk", lambda *a, **kw: routed.append(1) or real(*a, **kw),
                        raising=False)
    cases = [dict(), dict(return_intermediate_states=True), dict(chunk_indices=torch.tensor([[0, 0], [0, 1], [1, 0],
                                                                                            [2, 0]]))]
    with torch.no_grad():
        want = [call_chunk(spec, t, output_final_state=True, cu_seqlens=cu, **kw) for kw in cases]
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        got = [call_chunk(spec, t, output_final_state=True, cu_seqlens=cu, **kw) for kw in cases]
    assert routed == [1]
    for a, b in zip(got, want):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@gpu
@pytest.mark.parametrize("op", ["gdn", "kda", "gla", "simple_gla", "lightning"])
def test_chunk_compiles_fullgraph_on_gpu(op):
    """On the GPU (the kernel tiers, whose host code a trace could not hold): fullgraph with one
    fastla.chunk node, eager's results bit for bit, under inductor."""
    torch._dynamo.reset()
    spec = OPS[op]
    delta = op in ("gdn", "kda")
    t = make_inputs(spec, B=2, T=200, H=2, HV=4 if delta else 2, K=128, V=128, dtype=torch.bfloat16, device="cuda")
    opts = dict(use_qk_l2norm_in_kernel=True) if delta else {}
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    def step(t):
        return call_chunk(spec, t, output_final_state=True, **opts)

    with torch.no_grad():
        o, ht = step(t)
        co, cht = torch.compile(step, fullgraph=True, backend=backend)(t)
    assert torch.equal(co, o) and torch.equal(cht, ht)
    assert _fastla_ops(graphs) == ["fastla.chunk"]
