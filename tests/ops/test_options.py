"""Options computed inside the ops (gates, l2norm, beta sigmoid), the intermediate states,
and the chunk sizes, each against the fp64 reference."""
import pytest
import torch

from fastla.ops.gated_delta_rule import (
    chunk_gated_delta_rule, naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule,
)
from fastla.ops.kda import chunk_kda, naive_recurrent_kda
from fastla.ops.simple_gla import (
    chunk_simple_gla, fused_chunk_simple_gla, naive_recurrent_simple_gla, parallel_simple_gla,
)
from tests.helpers import OPS, as_leaves, assert_close, call_chunk, call_reference, make_inputs
from tests.ops.test_chunk_vs_reference import check_against_reference


def _raw_inputs(B, T, H, HV, K, V, channel: bool):
    t = {
        "q": torch.randn(B, T, H, K) * 3,
        "k": torch.randn(B, T, H, K) * 3,
        "v": torch.randn(B, T, HV, V),
        "g": torch.randn(B, T, HV, K) if channel else torch.randn(B, T, HV),
        "beta": torch.randn(B, T, HV),
        "initial_state": torch.randn(B, HV, K, V),
    }
    params = {"A_log": torch.randn(HV) * 0.5, "dt_bias": torch.randn(HV * K if channel else HV)}
    return t, params


def _check_with_params(fast, ref, t, params, **opts):
    """Like check_against_reference, also checking dA_log and ddt_bias."""
    leaves = as_leaves({**t, **params})
    o, ht = fast(**leaves, output_final_state=True, **opts)[:2]
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    rleaves = as_leaves({**t, **params}, torch.float64)
    q, k, v = rleaves.pop("q"), rleaves.pop("k"), rleaves.pop("v")
    ro, rht = ref(q, k, v, **rleaves, output_final_state=True, **opts)
    ((ro * do.double()).sum() + (rht * dht.double()).sum()).backward()
    rleaves.update(q=q, k=k, v=v)
    assert_close("o", o, ro, 2e-5)
    assert_close("final_state", ht, rht, 2e-5)
    for name, x in leaves.items():
        assert_close(f"d{name}", x.grad, rleaves[name].grad, 2e-4)


@pytest.mark.parametrize("neg", [False, True])
@pytest.mark.parametrize("HV", [2, 6])
def test_gdn_everything_in_op(neg, HV):
    t, params = _raw_inputs(1, 90, 2, HV, 32, 32, channel=False)
    _check_with_params(chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, t, params,
                       use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)


@pytest.mark.parametrize("lower_bound,with_A", [(None, True), (-5.0, True), (-5.0, False), (-1.0, True)])
def test_kda_gate_in_op(lower_bound, with_A):
    t, params = _raw_inputs(1, 90, 2, 4, 32, 32, channel=True)
    if not with_A:
        params.pop("A_log")
    _check_with_params(chunk_kda, naive_recurrent_kda, t, params, use_gate_in_kernel=True,
                       use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       safe_gate=lower_bound is not None, lower_bound=lower_bound)


def test_kda_lower_bound_keeps_gate_in_range():
    from fastla.core.gates import kda_gate
    g = kda_gate(torch.randn(4, 3, 8) * 50, torch.randn(3), torch.randn(24), -5.0)
    assert g.min() >= -5.0 and g.max() <= 0.0


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("varlen", [False, True])
def test_intermediate_states(op, varlen):
    """h[:, c] is the state before chunk c: the reference's final state on the prefix."""
    spec = OPS[op]
    lengths = [70, 1, 130] if varlen else [150, 150]
    C = 64
    if varlen:
        t = make_inputs(spec, B=1, T=sum(lengths), H=2, HV=4, K=32, V=16, N=len(lengths))
        cu = torch.tensor([0, 70, 71, 201])
        opts = {"cu_seqlens": cu}
    else:
        t = make_inputs(spec, B=2, T=150, H=2, HV=4, K=32, V=16)
        opts = {}
    with torch.inference_mode():
        o, ht, h = call_chunk(spec, t, output_final_state=True, return_intermediate_states=True, **opts)
    counts = [-(-n // C) for n in lengths]
    assert h.shape == ((1, sum(counts)) if varlen else (2, counts[0])) + (4, 32, 16)
    assert h.dtype == t["k"].dtype
    starts = [0, 70, 71] if varlen else [0, 0]
    row = 0
    for n, (n_len, n_chunks) in enumerate(zip(lengths, counts)):
        for c in range(n_chunks):
            got = h[0, row] if varlen else h[n, c]
            row += 1
            if c == 0:
                expect = t["initial_state"][n]
            else:
                b = 0 if varlen else n
                s0 = starts[n] if varlen else 0
                sub = {name: x[b:b + 1, s0:s0 + c * C] for name, x in t.items() if name != "initial_state"}
                sub["initial_state"] = t["initial_state"][n:n + 1]
                expect = call_reference(spec, sub, output_final_state=True)[1][0]
            assert_close(f"h[{n},{c}]", got, expect, 2e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_gdn_chunk_sizes(chunk_size):
    check_against_reference(OPS["gdn"], make_inputs(OPS["gdn"], B=1, T=100),
                            fast_only={"chunk_size": chunk_size})


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_kda_chunk_sizes(chunk_size):
    check_against_reference(OPS["kda"], make_inputs(OPS["kda"], B=1, T=100),
                            fast_only={"chunk_size": chunk_size})


def test_simple_gla_g_and_g_gamma():
    t = make_inputs(OPS["simple_gla"], B=2, T=80, H=3)
    gamma = -torch.rand(3)
    o, ht = chunk_simple_gla(**t, g_gamma=gamma, output_final_state=True)
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    ro, rht = naive_recurrent_simple_gla(q, k, v, **t, g_gamma=gamma, output_final_state=True)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


def test_simple_gla_no_decay_is_linear_attention():
    B, T, H, K, V = 1, 50, 1, 8, 8
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
    o, _ = chunk_simple_gla(q, k, v, scale=1.0)
    scores = torch.einsum("bihk,bjhk->bhij", q, k).tril()
    expect = torch.einsum("bhij,bjhv->bihv", scores, v)
    assert_close("o", o, expect, 1e-5)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_naive_chunk_gated_delta_rule(chunk_size):
    """FLA's chunked GDN reference with FLA's positional calls (g before beta in the chunked one,
    beta before g in the recurrent one): fp32 against the fp64 recurrence."""
    t = make_inputs(OPS["gdn"], B=2, T=90, H=2)
    q, k, v, g, beta, h0 = (t[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
    o, ht = naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, 0.4, h0, True)
    ro, rht = naive_recurrent_gated_delta_rule(q, k, v, beta, g, 0.4, h0, True)
    assert o.dtype == ht.dtype == torch.float32 and ro.dtype == torch.float64
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)
    assert naive_chunk_gated_delta_rule(q, k, v, g, beta)[1] is None
    with pytest.raises(ValueError, match="chunk_size"):
        naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=48)


def test_fused_chunk_simple_gla_is_chunk_simple_gla():
    """FLA's second chunked entry point: its positional order (cu_seqlens ninth), against fp64."""
    t = make_inputs(OPS["simple_gla"], B=1, T=150, H=3)
    q, k, v, g, h0 = (t[n] for n in ("q", "k", "v", "g", "initial_state"))
    h0 = torch.cat([h0, h0.flip(-1)])
    cu = torch.tensor([0, 40, 150])
    o, ht = fused_chunk_simple_gla(q, k, v, g, None, 0.3, h0, True, cu)
    ro, rht = naive_recurrent_simple_gla(q, k, v, g=g, scale=0.3, initial_state=h0, output_final_state=True,
                                         cu_seqlens=cu)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


def _decayed_scores(q, k, g, scale, cu):
    """attn [B, H, T, T] in fp64 from its definition, entry by entry over the sequences."""
    B, T, H, _ = q.shape
    G = g.double().cumsum(1)
    attn = torch.zeros(B, H, T, T, dtype=torch.float64)
    bounds = list(zip(cu[:-1], cu[1:])) if cu is not None else [(0, T)]
    for s0, s1 in bounds:
        for i in range(s0, s1):
            for j in range(s0, i + 1):
                dot = (q[:, i].double() * k[:, j].double()).sum(-1)                 # [B, H]
                attn[:, :, i, j] = scale * dot * torch.exp(G[:, i] - G[:, j])
    return attn


@pytest.mark.parametrize("varlen", [False, True])
def test_parallel_simple_gla(varlen, monkeypatch):
    """Output against fp64 (no initial state), the scores against their definition (rows in blocks
    of 16 here, so block edges and a reference row inside a sequence are crossed), and the output's
    gradient reaching q, k, v and g."""
    from fastla.ops.simple_gla import parallel
    monkeypatch.setattr(parallel, "ROWS", 16)
    t = make_inputs(OPS["simple_gla"], B=1 if varlen else 2, T=70, H=2, strength=3.0)
    q, k, v, g = (t[n].requires_grad_() for n in ("q", "k", "v", "g"))
    cu = torch.tensor([0, 23, 24, 70]) if varlen else None
    o, attn = parallel_simple_gla(q, k, v, g, scale=0.5, output_attentions=True, cu_seqlens=cu)
    ro, _ = naive_recurrent_simple_gla(q, k, v, g=g, scale=0.5, cu_seqlens=cu)
    assert_close("o", o, ro, 2e-5)
    assert attn.shape == (q.shape[0], 2, 70, 70) and attn.dtype == q.dtype
    assert_close("attn", attn, _decayed_scores(q.detach(), k.detach(), g.detach(), 0.5,
                                               cu.tolist() if varlen else None), 2e-6)
    o2, none = parallel_simple_gla(q, k, v, g, scale=0.5, cu_seqlens=cu)
    assert none is None and torch.equal(o2, o)
    o.square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, g))


def test_parallel_simple_gla_validates():
    t = make_inputs(OPS["simple_gla"], B=1, T=8, H=1)
    with pytest.raises(ValueError, match="output_attentions"):
        parallel_simple_gla(t["q"], t["k"], t["v"], t["g"], output_attentions=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        parallel_simple_gla(t["q"].expand(2, -1, -1, -1), t["k"].expand(2, -1, -1, -1),
                            t["v"].expand(2, -1, -1, -1), cu_seqlens=torch.tensor([0, 8]))


def test_transpose_state_layout_alias_warns():
    spec = OPS["gla"]
    t = make_inputs(spec, B=1, T=20, H=1, K=8, V=8, v_first=True)
    with pytest.warns(DeprecationWarning):
        o1, h1 = call_chunk(spec, t, output_final_state=True, transpose_state_layout=True)
    o2, h2 = call_chunk(spec, t, output_final_state=True, state_v_first=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)


def test_l2norm_matches_fla_formula():
    from fastla.core.gates import l2norm
    x = torch.randn(5, 7)
    assert_close("l2norm", l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6), 1e-7)


# FLA's output dtype: q's for these ops, v's for chunk_gla and the GDN / KDA recurrent ops
OUTPUT_LIKE = {"gdn": ("q", "v"), "kda": ("q", "v"), "gla": ("v", "q"), "simple_gla": ("q", "q"),
               "lightning": ("q", "q")}


@pytest.mark.parametrize("op", list(OPS))
def test_output_dtype_follows_fla(op):
    from tests.helpers import call_recurrent
    spec = OPS[op]
    t = make_inputs(spec, B=1, T=9, H=2, K=16, V=16)
    t["q"], t["k"] = t["q"].bfloat16(), t["k"].bfloat16()
    chunk_like, rec_like = OUTPUT_LIKE[op]
    with torch.no_grad():
        o, _ = call_chunk(spec, t)
        o_rec, _ = call_recurrent(spec, t)
    assert o.dtype == t[chunk_like].dtype
    assert o_rec.dtype == t[rec_like].dtype


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_bf16_intermediate_states_take_k_dtype(op):
    spec = OPS[op]
    t = make_inputs(spec, B=1, T=70, H=1, K=16, V=16, dtype=torch.bfloat16)
    with torch.inference_mode():
        _, _, h = call_chunk(spec, t, return_intermediate_states=True)
    assert h.dtype == torch.bfloat16 and h.shape[1] == 2


def test_torch_tier_ignores_autocast():
    spec = OPS["gdn"]
    t = make_inputs(spec, B=1, T=100, H=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, ht = call_chunk(spec, t, output_final_state=True)
    ro, rht = call_reference(spec, t, output_final_state=True)
    assert_close("o", o, ro, 2e-5)
    assert_close("ht", ht, rht, 2e-5)


def test_varlen_equals_separate_sequences():
    """Packing sequences with cu_seqlens gives each sequence's own result."""
    spec = OPS["kda"]
    t = make_inputs(spec, B=1, T=128, H=1, N=2)
    o, ht = call_chunk(spec, t, output_final_state=True, cu_seqlens=torch.tensor([0, 37, 128]))
    for n, (s, e) in enumerate([(0, 37), (37, 128)]):
        part = {name: x[:, s:e] for name, x in t.items() if name != "initial_state"}
        part["initial_state"] = t["initial_state"][n:n + 1]
        po, pht = call_chunk(spec, part, output_final_state=True)
        assert_close(f"o[{n}]", o[:, s:e], po, 1e-6)
        assert_close(f"ht[{n}]", ht[n:n + 1], pht, 1e-6)


def test_gates_match_fla_formulas():
    """The gate math against FLA 0.6.0's own torch reference gates."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.gated_delta_rule.gate import naive_gdn_gate
        from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fastla.core.gates import gdn_gate, kda_gate
    HV, K = 3, 8
    g = torch.randn(2, 5, HV, K) * 3
    A, dt = torch.randn(HV), torch.randn(HV * K)
    assert_close("kda", kda_gate(g, A, dt, None), naive_kda_gate(g, A, dt), 1e-6)
    assert_close("kda lb", kda_gate(g, A, dt, -5.0), naive_kda_lowerbound_gate(g, A, dt, -5.0), 1e-6)
    assert_close("kda lb no A", kda_gate(g, None, dt, -3.0), naive_kda_lowerbound_gate(g, None, dt, -3.0), 1e-6)
    gs, dts = torch.randn(2, 5, HV) * 3, torch.randn(HV)
    assert_close("gdn", gdn_gate(gs, A, dts), naive_gdn_gate(gs, A, dts).float(), 1e-6)
