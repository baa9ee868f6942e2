"""Every public signature against FLA 0.6.0's: FLA's parameters, in FLA's order, with FLA's
defaults, are a prefix of ours; what we add is keyword-only. The keywords FLA reads from
``**kwargs`` are accepted explicitly (an unknown keyword is a TypeError here)."""
import importlib
import inspect
import warnings

import pytest

PUBLIC = {
    "gated_delta_rule": ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                         "chunk_gdn", "fused_recurrent_gdn"],
    "kda": ["chunk_kda", "fused_recurrent_kda"],
    "gla": ["chunk_gla", "fused_recurrent_gla"],
    "simple_gla": ["chunk_simple_gla", "fused_recurrent_simple_gla", "fused_chunk_simple_gla", "parallel_simple_gla"],
    "lightning_attn": ["chunk_lightning_attn", "fused_recurrent_lightning_attn"],
}
# keywords FLA 0.6.0 reads from **kwargs in these functions
FLA_KWARGS = {
    "chunk_gated_delta_rule": {"transpose_state_layout", "head_first", "chunk_size", "use_gate_in_kernel",
                               "A_log", "dt_bias"},
    "chunk_kda": {"transpose_state_layout", "A_log", "dt_bias", "chunk_size"},
    "chunk_simple_gla": {"head_first", "chunk_size"},
    "chunk_lightning_attn": {"head_first", "chunk_size"},
}
CASES = [(module, name) for module, names in PUBLIC.items() for name in names]


def _fla():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module("fla.ops")


@pytest.mark.parametrize("module,name", CASES, ids=[c[1] for c in CASES])
def test_signature_matches_fla(module, name):
    _fla()
    fla_fn = getattr(importlib.import_module(f"fla.ops.{module}"), name)
    ours_fn = getattr(importlib.import_module(f"fastla.ops.{module}"), name)
    fla_params = [p for p in inspect.signature(fla_fn).parameters.values() if p.kind != p.VAR_KEYWORD]
    ours = list(inspect.signature(ours_fn).parameters.values())
    assert all(p.kind != p.VAR_KEYWORD for p in ours), "fastla takes no **kwargs catch-all"
    assert [p.name for p in ours[:len(fla_params)]] == [p.name for p in fla_params]
    for mine, theirs in zip(ours, fla_params):
        assert mine.default == theirs.default, f"{name}({mine.name}): default {mine.default!r} vs FLA {theirs.default!r}"
        assert mine.kind == theirs.kind, f"{name}({mine.name}): kind {mine.kind} vs FLA {theirs.kind}"
    extra = ours[len(fla_params):]
    assert all(p.kind == p.KEYWORD_ONLY for p in extra), [p.name for p in extra if p.kind != p.KEYWORD_ONLY]
    names = {p.name for p in ours}
    missing = FLA_KWARGS.get(name, set()) - names
    assert not missing, f"{name} does not accept FLA's keywords {missing}"


@pytest.mark.parametrize("module", list(PUBLIC))
def test_module_exports(module):
    ours = importlib.import_module(f"fastla.ops.{module}")
    for name in PUBLIC[module]:
        assert callable(getattr(ours, name))


def test_fused_chunk_gla_raises_as_fla():
    """FLA 0.6.0 keeps ``fused_chunk_gla`` for imports and raises NotImplementedError (use chunk_gla)."""
    _fla()
    from fla.ops.gla import fused_chunk_gla as fla_fn

    from fastla.ops.gla import fused_chunk_gla
    for fn in (fla_fn, fused_chunk_gla):
        with pytest.raises(NotImplementedError, match="chunk_gla"):
            fn(q=None)


def test_top_level_exports_match_fla():
    """``fastla.ops`` exports FLA's top-level names for the ops it implements."""
    fla_ops = _fla()
    import fastla.ops
    ours = set(fastla.ops.__all__)
    modules = ("gated_delta_rule", "kda", "gla", "simple_gla", "lightning_attn")
    theirs = {n for n in fla_ops.__all__ if getattr(fla_ops, n).__module__.split(".")[2] in modules}
    assert theirs <= ours, sorted(theirs - ours)


@pytest.mark.parametrize("name", ["naive_recurrent_gated_delta_rule", "naive_chunk_gated_delta_rule"])
def test_gdn_references_take_fla_positions(name):
    """FLA exports two GDN references: our parameters start with theirs, in their order (g and beta
    stay optional on the recurrent one: it also takes gk / gv)."""
    _fla()
    fla_fn = getattr(importlib.import_module("fla.ops.gated_delta_rule"), name)
    ours_fn = getattr(importlib.import_module("fastla.ops.gated_delta_rule"), name)
    theirs = list(inspect.signature(fla_fn).parameters)
    assert list(inspect.signature(ours_fn).parameters)[:len(theirs)] == theirs
