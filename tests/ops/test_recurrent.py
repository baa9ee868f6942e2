"""The recurrent (decode) ops: against the reference, token-by-token decode equals the
chunked op, and the serving pool (in place, negative indices, per-token checkpoints,
num_accepted_tokens, disable_state_update)."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from fastla.core.dispatch import use_tier

from fastla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule
from fastla.ops.gla import fused_recurrent_gla, naive_recurrent_gla
from tests.helpers import (
    DEVICES, OPS, as_leaves, assert_close, call_chunk, call_recurrent, call_reference, make_inputs, on_device,
    skip_unservable,
)


TIERS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def _servable(request):
    """CPU inputs on the triton tier need the interpreter (helpers.skip_unservable)."""
    params = getattr(request.node, "callspec", None)
    if params is not None and "device" in params.params and "tier" in params.params:
        skip_unservable(params.params["device"], params.params["tier"])


def on_tier(tier):
    """Serve the calls in the block on ``tier`` and nothing else (no silent fall-through)."""
    stack = contextlib.ExitStack()
    stack.enter_context(use_tier(tier, strict=True))
    stack.enter_context(torch.no_grad())
    return stack


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_recurrent_matches_reference(op, v_first, device, tier):
    spec = OPS[op]
    t = make_inputs(spec, B=2, T=40, H=2, HV=4 if spec.gva else None, K=32, V=16, v_first=v_first, device=device)
    with on_tier(tier):
        o, ht = call_recurrent(spec, t, output_final_state=True, state_v_first=v_first)
    ro, rht = call_reference(spec, t, output_final_state=True, state_v_first=v_first)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_decode_token_by_token_equals_chunk(op, device, tier):
    spec = OPS[op]
    T = 20 if (tier, device) == ("triton", "cpu") else 70      # the Triton interpreter is slow
    t = make_inputs(spec, B=2, T=T, H=2, HV=4 if spec.gva else None, K=32, V=32, device=device)
    with use_tier("torch", strict=True):   # fp32 products (the kernel tiers' chunks use bf16 on a GPU)
        o_chunk, ht_chunk = call_chunk(spec, t, output_final_state=True)
    state = t["initial_state"]
    outs = []
    for i in range(T):
        step = {n: (x[:, i:i + 1] if n != "initial_state" else state) for n, x in t.items()}
        with on_tier(tier):
            o, state = call_recurrent(spec, step, output_final_state=True)
        outs.append(o)
    assert_close("o", torch.cat(outs, 1), o_chunk, 2e-5)
    assert_close("ht", state, ht_chunk, 2e-5)


@pytest.mark.parametrize("op", ["gla", "simple_gla", "lightning"])
def test_reverse(op):
    spec = OPS[op]
    cu = torch.tensor([0, 5, 40, 41])
    t = make_inputs(spec, B=1, T=41, H=2, K=16, V=16, N=3)
    o, ht = call_recurrent(spec, t, output_final_state=True, reverse=True, cu_seqlens=cu)
    ro, rht = call_reference(spec, t, output_final_state=True, reverse=True, cu_seqlens=cu)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)
    # reverse equals the forward op on time-flipped sequences
    flip = {n: (x.flip(1) if n != "initial_state" else x) for n, x in make_inputs(spec, B=1, T=9, seed=3).items()}
    unflipped = {n: (x.flip(1) if n != "initial_state" else x) for n, x in flip.items()}
    o_rev, _ = call_recurrent(spec, unflipped, reverse=True)
    o_fwd, _ = call_recurrent(spec, flip)
    assert_close("reverse vs flip", o_rev.flip(1), o_fwd, 1e-5)


def test_gla_value_gate_and_gradients():
    B, T, H, K, V = 2, 30, 2, 16, 8
    t = {"q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, H, V),
         "gk": F.logsigmoid(torch.randn(B, T, H, K)), "gv": F.logsigmoid(torch.randn(B, T, H, V)),
         "initial_state": torch.randn(B, H, K, V)}
    leaves = as_leaves(t)
    o, ht = fused_recurrent_gla(**leaves, output_final_state=True)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    r = as_leaves(t, torch.float64)
    ro, rht = naive_recurrent_gla(r["q"], r["k"], r["v"], g=r["gk"], gv=r["gv"], initial_state=r["initial_state"],
                                  output_final_state=True)
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)
    for n in t:
        assert_close(f"d{n}", leaves[n].grad, r[n].grad, 2e-4)


# (tier, with gv): the per-value gate is served by the torch tier only
@pytest.mark.parametrize("tier,with_gv", [("torch", True), ("torch", False), ("triton", False)])
@pytest.mark.parametrize("device", DEVICES)
def test_gdn_recurrent_with_scalar_key_and_value_gates(tier, with_gv, device):
    B, T, H, HV, K, V = 1, 25, 1, 2, 16, 8
    t = {"q": torch.randn(B, T, H, K), "k": F.normalize(torch.randn(B, T, H, K), dim=-1), "v": torch.randn(B, T, HV, V),
         "g": F.logsigmoid(torch.randn(B, T, HV)), "gk": F.logsigmoid(torch.randn(B, T, HV, K)),
         "beta": torch.rand(B, T, HV), "initial_state": torch.randn(B, HV, K, V)}
    if with_gv:
        t["gv"] = F.logsigmoid(torch.randn(B, T, HV, V))
    t = on_device(t, device)
    with on_tier(tier):
        o, ht = fused_recurrent_gated_delta_rule(**t, output_final_state=True)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, **t, output_final_state=True)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_gdn_recurrent_beta_defaults_to_one(device, tier):
    spec = OPS["gdn"]
    t = make_inputs(spec, B=1, T=10, H=1, device=device)
    t_none = {n: x for n, x in t.items() if n != "beta"}
    with on_tier(tier):
        o1, _ = call_recurrent(spec, t_none)
        t["beta"] = torch.ones_like(t["beta"])
        o2, _ = call_recurrent(spec, t)
    assert torch.equal(o1, o2)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_recurrent_gates_in_op(op, device, tier):
    """Gate (A_log, dt_bias, lower_bound), beta sigmoid and l2norm fused, GVA 3, varlen."""
    from fastla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as gdn_rec
    from fastla.ops.kda import fused_recurrent_kda, naive_recurrent_kda
    H, HV, K, V = 1, 3, 16, 8
    cu = torch.tensor([0, 1, 4, 9])
    channel = op == "kda"
    t = {"q": torch.randn(1, 9, H, K) * 2, "k": torch.randn(1, 9, H, K) * 2, "v": torch.randn(1, 9, HV, V),
         "g": torch.randn(1, 9, HV, K) if channel else torch.randn(1, 9, HV), "beta": torch.randn(1, 9, HV),
         "initial_state": torch.randn(3, HV, K, V), "A_log": torch.randn(HV) * 0.5,
         "dt_bias": torch.randn(HV * K if channel else HV)}
    t = on_device(t, device)
    opts = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, output_final_state=True, cu_seqlens=cu.to(device))
    cases = [dict()] if not channel else [dict(), dict(lower_bound=-5.0), dict(lower_bound=-2.0, A_log=None)]
    for extra in cases:
        args = {**t, **extra}
        with on_tier(tier):
            o, ht = (fused_recurrent_kda if channel else gdn_rec)(**args, **opts)
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        ro, rht = (naive_recurrent_kda if channel else naive_recurrent_gated_delta_rule)(q, k, v, **args, **opts)
        assert_close(f"o {extra}", o, ro, 2e-5)
        assert_close(f"ht {extra}", ht, rht, 2e-5)


# ----------------------------------------------------------------------------- state pool

def _pool_case(spec, N=4, slots=7, T=1, state_dtype=torch.float32, v_first=False, device="cpu"):
    HV = 4 if spec.gva else 2
    t = make_inputs(spec, B=1, T=N * T, H=2, HV=HV, K=16, V=8, h0=False, device=device)
    pool = torch.randn(slots, HV, 8, 16) if v_first else torch.randn(slots, HV, 16, 8)
    cu = torch.arange(0, N * T + 1, T)
    return t, pool.to(device, state_dtype), cu.to(device)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_pool_in_place_with_negative_indices(op, state_dtype, v_first, device, tier):
    spec = OPS[op]
    t, pool, cu = _pool_case(spec, T=3, state_dtype=state_dtype, v_first=v_first, device=device)
    idx = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device=device)
    before = pool.clone()
    with on_tier(tier):
        o, returned = call_recurrent(spec, {**t, "initial_state": pool}, cu_seqlens=cu, ssm_state_indices=idx,
                                     state_v_first=v_first)
    assert returned is pool
    for slot in (1, 3, 4, 6):                        # untouched slots bit-identical
        assert torch.equal(pool[slot], before[slot])
    assert torch.equal(o[0, 3:6], torch.zeros_like(o[0, 3:6]))    # skipped row: zero output
    for n, slot in [(0, 5), (2, 0), (3, 2)]:
        seq = {name: x[:, 3 * n:3 * n + 3] for name, x in t.items()}
        ro, rht = call_reference(spec, {**seq, "initial_state": before[slot:slot + 1].float()},
                                 output_final_state=True, state_v_first=v_first)
        assert_close(f"o[{n}]", o[:, 3 * n:3 * n + 3], ro, 5e-3 if state_dtype == torch.bfloat16 else 2e-5)
        assert_close(f"pool[{slot}]", pool[slot], rht[0], 5e-3 if state_dtype == torch.bfloat16 else 2e-5)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_pool_per_token_checkpoints_and_accepted_tokens(op, index_dtype, device, tier):
    spec = OPS[op]
    N, T = 3, 4
    t, pool, cu = _pool_case(spec, N=N, slots=16, T=T, device=device)
    idx = torch.arange(N * T, dtype=index_dtype, device=device).reshape(N, T)
    idx[1, 3] = -1                                   # this token's checkpoint is not kept
    accepted = torch.tensor([1, 3, 2], dtype=index_dtype, device=device)
    before = pool.clone()
    with on_tier(tier):
        o, _ = call_recurrent(spec, {**t, "initial_state": pool}, cu_seqlens=cu, ssm_state_indices=idx,
                              num_accepted_tokens=accepted)
    for n in range(N):
        start = before[idx[n, accepted[n] - 1]]
        for j in range(T):
            seq = {name: x[:, T * n:T * n + j + 1] for name, x in t.items()}
            ro, rht = call_reference(spec, {**seq, "initial_state": start[None]}, output_final_state=True)
            slot = int(idx[n, j])
            if slot >= 0:
                assert_close(f"pool[{slot}]", pool[slot], rht[0], 2e-5)
        assert_close(f"o[{n}]", o[:, T * n:T * n + T], ro, 2e-5)
    assert torch.equal(pool[12:], before[12:])


@pytest.mark.parametrize("op", ["gdn", "simple_gla"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_pool_disable_state_update(op, device, tier):
    spec = OPS[op]
    t, pool, cu = _pool_case(spec, T=2, device=device)
    before = pool.clone()
    idx = torch.tensor([0, 1, 2, 3], device=device)
    with on_tier(tier):
        o, _ = call_recurrent(spec, {**t, "initial_state": pool}, cu_seqlens=cu, ssm_state_indices=idx,
                              disable_state_update=True)
        assert torch.equal(pool, before)
        o2, _ = call_recurrent(spec, {**t, "initial_state": pool.clone()}, cu_seqlens=cu, ssm_state_indices=idx)
    assert torch.equal(o, o2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_pool_decode_is_graph_capturable(op):
    """Validation reads no device values during capture; replay equals eager calls."""
    spec = OPS[op]
    N, T = 8, 2
    t, pool, cu = _pool_case(spec, N=N, slots=20, T=T, device="cuda")
    idx = torch.arange(0, 2 * N, 2, device="cuda", dtype=torch.int32)
    idx[3] = -1
    eager_pool = pool.clone()
    with torch.no_grad():
        o_eager, _ = call_recurrent(spec, {**t, "initial_state": eager_pool}, cu_seqlens=cu, ssm_state_indices=idx)
        static_pool = pool.clone()
        call_recurrent(spec, {**t, "initial_state": static_pool.clone()}, cu_seqlens=cu, ssm_state_indices=idx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph, _ = call_recurrent(spec, {**t, "initial_state": static_pool}, cu_seqlens=cu,
                                        ssm_state_indices=idx)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(o_graph, o_eager)
    assert torch.equal(static_pool, eager_pool)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lightning_decay_first_built_under_capture():
    """Lightning's per-layer decay, first asked for inside a CUDA-graph capture (a layer no eager
    call has used), is built inside the graph and not cached empty: the replay and a later eager
    call both equal the reference."""
    from fastla.ops.lightning_attn import fused_recurrent_lightning_attn, naive_recurrent_lightning_attn

    t = {n: x.cuda() for n, x in make_inputs(OPS["lightning"], B=2, T=1, H=3, K=16, V=16).items()}
    layers = dict(layer_idx=5, num_layers=13)
    with torch.no_grad():
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_graph, _ = fused_recurrent_lightning_attn(**t, **layers, output_final_state=True)
        graph.replay()
        o_eager, _ = fused_recurrent_lightning_attn(**t, **layers, output_final_state=True)
        torch.cuda.synchronize()
    # (the reference on the CPU: its decay is not the CUDA tensor under test)
    ro, _ = naive_recurrent_lightning_attn(*(t[n].cpu().double() for n in ("q", "k", "v")),
                                           initial_state=t["initial_state"].cpu().double(), **layers)
    assert_close("o (graph)", o_graph.cpu(), ro, 1e-4)
    assert_close("o (eager after the capture)", o_eager.cpu(), ro, 1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_permuted_value_tensor(device, tier):
    """A dense but permuted v (e.g. from a transpose) is read through its strides; o is contiguous."""
    spec = OPS["gdn"]
    t = make_inputs(spec, B=2, T=6, H=2, HV=4, K=16, V=8, device=device)
    t["v"] = t["v"].transpose(1, 2).contiguous().transpose(1, 2)      # [B, T, HV, V] view, HV-major memory
    assert not t["v"].is_contiguous()
    with on_tier(tier):
        o, ht = call_recurrent(spec, t, output_final_state=True)
    ro, rht = call_reference(spec, t, output_final_state=True)
    assert o.is_contiguous()
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tier", TIERS)
def test_pool_strided_indices_and_skipped_start(device, tier):
    """2-D indices given as a transposed view; a row whose start slot is negative writes nothing."""
    spec = OPS["gdn"]
    N, T = 3, 2
    t, pool, cu = _pool_case(spec, N=N, slots=12, T=T, device=device)
    idx = torch.tensor([[0, 4, 8], [1, 5, 9]], device=device).T                      # [N, T] with column stride 3... as a view
    idx = idx.clone()
    idx[1, 0] = -1                                                    # sequence 1: skipped from its start
    idx = idx.T.contiguous().T                                        # non-unit inner stride
    assert idx.stride(1) != 1
    before = pool.clone()
    with on_tier(tier):
        o, _ = call_recurrent(spec, {**t, "initial_state": pool}, cu_seqlens=cu, ssm_state_indices=idx)
    assert torch.equal(o[:, T:2 * T], torch.zeros_like(o[:, T:2 * T]))
    assert torch.equal(pool[5], before[5]) and torch.equal(pool[4], before[4])
    for n in (0, 2):
        seq = {name: x[:, T * n:T * n + T] for name, x in t.items()}
        for j in range(T):
            sub = {name: x[:, :j + 1] for name, x in seq.items()}
            _, rht = call_reference(spec, {**sub, "initial_state": before[idx[n, 0]][None]}, output_final_state=True)
            assert_close(f"pool[{int(idx[n, j])}]", pool[idx[n, j]], rht[0], 2e-5)


def test_learnable_g_gamma_keeps_its_gradient():
    spec = OPS["simple_gla"]
    t = make_inputs(spec, B=1, T=5, H=2, K=8, V=8)
    t.pop("g")
    gamma = (-torch.rand(2)).requires_grad_(True)
    o, _ = fused_recurrent_simple_gla_op(**t, g_gamma=gamma)
    o.sum().backward()
    assert gamma.grad is not None and torch.isfinite(gamma.grad).all()


def fused_recurrent_simple_gla_op(**kw):
    from fastla.ops.simple_gla import fused_recurrent_simple_gla
    return fused_recurrent_simple_gla(**kw)
