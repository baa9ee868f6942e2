"""Every validation error: a ValueError (or NotImplementedError for an unserved option)
whose message names the argument."""
import pytest
import torch

from fastla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fastla.ops.gla import chunk_gla
from fastla.ops.kda import chunk_kda, fused_recurrent_kda
from fastla.ops.lightning_attn import chunk_lightning_attn
from fastla.ops.simple_gla import chunk_simple_gla
from tests.helpers import OPS, make_inputs

B, T, H, HV, K, V = 2, 16, 2, 4, 16, 8


def gdn(**over):
    t = make_inputs(OPS["gdn"], B=B, T=T, H=H, HV=HV, K=K, V=V, h0=False)
    t.update(over)
    return t


def kda(**over):
    t = make_inputs(OPS["kda"], B=B, T=T, H=H, HV=HV, K=K, V=V, h0=False)
    t.update(over)
    return t


CASES = [
    ("k shape", lambda: chunk_gated_delta_rule(**gdn(k=torch.randn(B, T, H, K + 1))), "k must have shape"),
    ("v batch", lambda: chunk_gated_delta_rule(**gdn(v=torch.randn(B + 1, T, HV, V))), "v must have shape"),
    ("HV not multiple", lambda: chunk_gated_delta_rule(**gdn(v=torch.randn(B, T, 3, V),
                                                           g=torch.randn(B, T, 3), beta=torch.rand(B, T, 3))),
     "multiple of the H=2"),
    ("g shape", lambda: chunk_gated_delta_rule(**gdn(g=torch.randn(B, T, H))), "g must have shape"),
    ("beta shape", lambda: chunk_gated_delta_rule(**gdn(beta=torch.rand(B, T))), "beta must have shape"),
    ("kda g shape", lambda: chunk_kda(**kda(g=torch.randn(B, T, HV))), "g must have shape"),
    ("gla heads", lambda: chunk_gla(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 4, 8),
                                    torch.randn(1, 4, 2, 8)), "v must have the H=2 heads"),
    ("non-floating q", lambda: chunk_gated_delta_rule(**gdn(q=torch.ones(B, T, H, K, dtype=torch.int64))),
     "q must be a floating-point tensor"),
    ("q rank", lambda: chunk_gated_delta_rule(**gdn(q=torch.randn(T, H, K))), "q must have shape"),
    ("head dim", lambda: chunk_simple_gla(torch.randn(1, 4, 1, 300), torch.randn(1, 4, 1, 300),
                                          torch.randn(1, 4, 1, 8)), "head dims 1..256"),
    ("cu_seqlens with B>1", lambda: chunk_gated_delta_rule(**gdn(), cu_seqlens=torch.tensor([0, T])),
     "B == 1"),
    ("cu_seqlens start", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens=torch.tensor([1, 2 * T])),
     "must start at 0"),
    ("cu_seqlens decreasing", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens=torch.tensor([0, 9, 3, 2 * T])),
     "non-decreasing"),
    ("cu_seqlens end", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens=torch.tensor([0, 5])),
     "must end at T=32"),
    ("cu_seqlens float", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens=torch.tensor([0.0, 32.0])),
     "cu_seqlens must be int32 or int64"),
    ("cu_seqlens_cpu end", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens_cpu=torch.tensor([0, 31])),
     "cu_seqlens_cpu must end at T=32"),
    ("cu_seqlens_cpu differs", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens=torch.tensor([0, 1, 32]),
                                                              cu_seqlens_cpu=torch.tensor([0, 4, 32])),
     "cu_seqlens_cpu must hold the same offsets"),
    ("initial_state N", lambda: chunk_gated_delta_rule(**gdn(), initial_state=torch.randn(B + 1, HV, K, V)),
     "one state per sequence"),
    ("initial_state heads", lambda: chunk_gated_delta_rule(**gdn(), initial_state=torch.randn(B, H, K, V)),
     "initial_state must have shape"),
    ("initial_state layout", lambda: chunk_gated_delta_rule(**gdn(), initial_state=torch.randn(B, HV, V, K)),
     "initial_state must have shape [N, HV, K, V]"),
    ("initial_state v-first", lambda: chunk_gated_delta_rule(**gdn(), initial_state=torch.randn(B, HV, K, V),
                                                             state_v_first=True),
     "state_v_first=True"),
    ("lower_bound range", lambda: chunk_kda(**kda(), use_gate_in_kernel=True, A_log=torch.randn(HV),
                                            safe_gate=True, lower_bound=-6.0), "lower_bound must be in [-5, 0)"),
    ("lower_bound missing", lambda: chunk_kda(**kda(), use_gate_in_kernel=True, A_log=torch.randn(HV),
                                              safe_gate=True), "lower_bound must be given"),
    ("A_log missing gdn", lambda: chunk_gated_delta_rule(**gdn(), use_gate_in_kernel=True), "A_log must be given"),
    ("A_log missing kda", lambda: chunk_kda(**kda(), use_gate_in_kernel=True), "A_log must be given"),
    ("A_log shape", lambda: chunk_gated_delta_rule(**gdn(), use_gate_in_kernel=True, A_log=torch.randn(H)),
     "A_log must have shape [4]"),
    ("dt_bias shape kda", lambda: chunk_kda(**kda(), use_gate_in_kernel=True, A_log=torch.randn(HV),
                                            dt_bias=torch.randn(HV)), "dt_bias must have shape [64]"),
    ("allow_neg_eigval", lambda: chunk_gated_delta_rule(**gdn(), allow_neg_eigval=True),
     "requires use_beta_sigmoid_in_kernel"),
    ("chunk_size", lambda: chunk_kda(**kda(), chunk_size=16), "chunk_size must be one of (32, 64)"),
    ("chunk_size pow2", lambda: chunk_simple_gla(torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8),
                                                 torch.randn(1, 4, 1, 8), chunk_size=48), "power of 2"),
    ("head_first", lambda: chunk_gated_delta_rule(**gdn(), head_first=True), "head_first"),
    ("both layouts", lambda: chunk_gated_delta_rule(**gdn(), state_v_first=True, transpose_state_layout=True),
     "not both"),
    ("layer_idx", lambda: chunk_lightning_attn(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8),
                                               torch.randn(1, 4, 2, 8), layer_idx=9, num_layers=8), "layer_idx"),
    ("num_layers", lambda: chunk_lightning_attn(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8),
                                                torch.randn(1, 4, 2, 8), layer_idx=0, num_layers=0), "num_layers"),
    ("scale", lambda: chunk_gated_delta_rule(**gdn(), scale=float("nan")), "scale must be a finite number"),
    ("chunk_indices", lambda: chunk_gated_delta_rule(**gdn_b1(), cu_seqlens=torch.tensor([0, 32]),
                                                     chunk_indices=torch.zeros(3, 2, dtype=torch.int64)),
     "chunk_indices must have shape [1, 2]"),
    ("pool index range", lambda: fused_recurrent_gated_delta_rule(
        **gdn(), initial_state=torch.randn(3, HV, K, V), ssm_state_indices=torch.tensor([0, 3])),
     "ssm_state_indices out of range"),
    ("pool index dtype", lambda: fused_recurrent_gated_delta_rule(
        **gdn(), initial_state=torch.randn(3, HV, K, V), ssm_state_indices=torch.tensor([0.0, 1.0])),
     "ssm_state_indices must be an int32 or int64"),
    ("pool index count", lambda: fused_recurrent_gated_delta_rule(
        **gdn(), initial_state=torch.randn(3, HV, K, V), ssm_state_indices=torch.tensor([0, 1, 2])),
     "N=2 sequences"),
    ("pool without state", lambda: fused_recurrent_gated_delta_rule(**gdn(), ssm_state_indices=torch.tensor([0, 1])),
     "requires initial_state"),
    ("accepted needs 2-D", lambda: fused_recurrent_kda(
        **kda(), initial_state=torch.randn(3, HV, K, V), ssm_state_indices=torch.tensor([0, 1]),
        num_accepted_tokens=torch.tensor([1, 1])), "requires 2-D ssm_state_indices"),
    ("accepted range", lambda: fused_recurrent_kda(
        **kda(), initial_state=torch.randn(40, HV, K, V), ssm_state_indices=torch.arange(2 * T).reshape(2, T),
        num_accepted_tokens=torch.tensor([0, 1])), "num_accepted_tokens must lie in [1, 16]"),
    ("2-D indices too short", lambda: fused_recurrent_kda(
        **kda(), initial_state=torch.randn(40, HV, K, V), ssm_state_indices=torch.zeros(2, 3, dtype=torch.int64)),
     "a slot per token"),
    ("gate raw missing chunk", lambda: chunk_gated_delta_rule(
        **{**gdn(), "g": None}, use_gate_in_kernel=True, A_log=torch.randn(HV)), "g (the raw gate input)"),
    ("kda gate raw missing", lambda: chunk_kda(**{**kda(), "g": None}, use_gate_in_kernel=True,
                                               A_log=torch.randn(HV)), "g (the raw gate input)"),
    ("k dtype", lambda: chunk_gated_delta_rule(**gdn(k=torch.randn(B, T, H, K, dtype=torch.float64))),
     "k must have q's dtype"),
    ("zero heads", lambda: chunk_simple_gla(torch.randn(1, 4, 0, 8), torch.randn(1, 4, 0, 8),
                                            torch.randn(1, 4, 0, 8)), "at least one head"),
    ("2-D indices with T=0", lambda: fused_recurrent_kda(
        **{n: x[:, :0] for n, x in kda().items()}, initial_state=torch.randn(4, HV, K, V),
        ssm_state_indices=torch.zeros(2, 0, dtype=torch.int64)), "a slot per token"),
    ("gate raw missing", lambda: fused_recurrent_gated_delta_rule(
        **{n: x for n, x in gdn().items() if n != "g"}, use_gate_in_kernel=True, A_log=torch.randn(HV)),
     "g (the raw gate input)"),
]


def gdn_b1():
    t = make_inputs(OPS["gdn"], B=1, T=2 * T, H=H, HV=HV, K=K, V=V, h0=False)
    return t


@pytest.mark.parametrize("name,call,message", CASES, ids=[c[0] for c in CASES])
def test_value_errors(name, call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value), str(info.value)


def test_cp_context_not_implemented():
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_gated_delta_rule(**gdn(), cp_context=object())


def test_headwise_beta_not_implemented():
    with pytest.raises(NotImplementedError, match="beta of shape"):
        fused_recurrent_kda(**kda(beta=torch.rand(B, T, HV, V)))


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError):
        chunk_gated_delta_rule(**gdn(), not_an_option=True)


def test_device_mismatch_named():
    with pytest.raises(ValueError, match="k is on meta"):
        chunk_gated_delta_rule(**gdn(k=torch.randn(B, T, H, K, device="meta")))
    with pytest.raises(ValueError, match="num_accepted_tokens is on meta"):
        fused_recurrent_kda(**kda(), initial_state=torch.randn(40, HV, K, V),
                            ssm_state_indices=torch.arange(2 * T).reshape(2, T),
                            num_accepted_tokens=torch.ones(2, dtype=torch.int64, device="meta"))


def test_cu_seqlens_cpu_on_a_device_warns():
    """FLA takes ``cu_seqlens_cpu`` on a GPU (every call then syncs to read it): fastla does too, and
    says so (here a meta tensor stands in for a device one; its values cannot be read)."""
    with pytest.warns(RuntimeWarning, match="cu_seqlens_cpu is on meta.*pass a CPU tensor"):
        with pytest.raises(Exception):
            chunk_gated_delta_rule(**gdn_b1(), cu_seqlens_cpu=torch.tensor([0, 32], device="meta"))
