"""The named benchmark configs: model-shaped problems for every public op.

A :class:`BenchConfig` names one problem (shapes, dtypes, the op's keyword options and
the modes it is timed in). Names are stable, ``<family>/<heads>/<shape>``, e.g.
``gdn/h16-hv64/1x32768`` or ``kda-decode/h32-hv32/n64``, so results of different runs
line up. Nothing here imports torch: listing and filtering configs works anywhere.

Families and the public function each one times (same name in ``fastla.ops`` and
``fla.ops``):

- ``gdn``: ``gated_delta_rule.chunk_gated_delta_rule``, Qwen3.5 head counts from TP1
  (16 q/k heads, 64 value heads) down to TP8 (2/8).
- ``kda``: ``kda.chunk_kda``, Kimi-Linear options (gate, l2norm and beta sigmoid in
  the op, ``safe_gate``, ``lower_bound=-5``).
- ``gla``, ``simple_gla``, ``lightning``: the plain (non-delta) rules.
- ``gdn-decode``, ``kda-decode``: ``fused_recurrent_*`` with one token per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable

MODES = ("fwd", "fwdbwd", "decode")
CHUNK_MODES = ("fwd", "fwdbwd")
DECODE_MODES = ("decode",)


@dataclass(frozen=True)
class OpSpec:
    """Where a public op lives and what kind of recurrence it computes."""

    package: str          # sub-package of ``fastla.ops`` / ``fla.ops``
    function: str         # public function name
    delta: bool           # delta rule (needs beta) or plain rule
    gate: str             # "scalar" [.., HV], "channel" [.., HV, K], "gamma" [H], "lightning", "none"
    recurrent: bool       # fused_recurrent (token by token) or chunked


OPS: dict[str, OpSpec] = {
    "chunk_gated_delta_rule": OpSpec("gated_delta_rule", "chunk_gated_delta_rule", True, "scalar", False),
    "fused_recurrent_gated_delta_rule": OpSpec(
        "gated_delta_rule", "fused_recurrent_gated_delta_rule", True, "scalar", True),
    "chunk_kda": OpSpec("kda", "chunk_kda", True, "channel", False),
    "fused_recurrent_kda": OpSpec("kda", "fused_recurrent_kda", True, "channel", True),
    "chunk_gla": OpSpec("gla", "chunk_gla", False, "channel", False),
    "chunk_simple_gla": OpSpec("simple_gla", "chunk_simple_gla", False, "gamma", False),
    "chunk_lightning_attn": OpSpec("lightning_attn", "chunk_lightning_attn", False, "lightning", False),
}


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark problem.

    ``T`` is the token count per row; with ``lengths`` (varlen) ``B`` is 1 and ``T`` is
    their sum. ``options`` are the op's non-tensor keyword arguments, passed verbatim
    to both libraries. ``gate_strength`` scales precomputed log decays
    (``strength * logsigmoid(randn)``); ``dtype`` is the dtype of q, k, v.
    """

    op: str
    name: str
    B: int
    T: int
    H: int
    HV: int
    K: int = 128
    V: int = 128
    lengths: tuple[int, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    modes: tuple[str, ...] = CHUNK_MODES
    dtype: str = "bfloat16"
    initial_state: bool = True
    gate_strength: float = 1.0

    @property
    def spec(self) -> OpSpec:
        return OPS[self.op]

    @property
    def family(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def is_varlen(self) -> bool:
        return self.lengths is not None

    @property
    def N(self) -> int:
        """Number of sequences (rows of the state)."""
        return len(self.lengths) if self.lengths is not None else self.B

    @property
    def max_len(self) -> int:
        return max(self.lengths) if self.lengths is not None else self.T

    @property
    def token_heads(self) -> int:
        """Tokens times value heads: the unit of the per-token-head budgets."""
        return self.B * self.T * self.HV

    def describe(self) -> str:
        shape = f"varlen {list(self.lengths)}" if self.lengths is not None else f"B{self.B} T{self.T}"
        return f"{self.op} {shape} H{self.H} HV{self.HV} K{self.K} V{self.V}"


GDN_HEADS = ((16, 64), (16, 32), (8, 32), (4, 16), (2, 8))
GDN_VARLEN = (7000, 1300, 547, 2048, 963, 271, 3063, 1, 1191)
KDA_VARLEN = (1300, 547, 2048, 963, 271, 3063, 1, 7000)
DECODE_BATCHES = (1, 16, 64, 256)

GDN_OPTIONS = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
KDA_OPTIONS = {
    "use_qk_l2norm_in_kernel": True,
    "use_gate_in_kernel": True,
    "use_beta_sigmoid_in_kernel": True,
    "safe_gate": True,
    "lower_bound": -5.0,
    "output_final_state": True,
}
PLAIN_OPTIONS = {"output_final_state": True}
LIGHTNING_OPTIONS = {"layer_idx": 12, "num_layers": 24, "output_final_state": True}
GDN_DECODE_OPTIONS = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
KDA_DECODE_OPTIONS = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}


def _shape_name(B: int, T: int, lengths: tuple[int, ...] | None) -> str:
    if lengths is not None:
        return f"varlen{len(lengths)}x{sum(lengths)}"
    return f"{B}x{T}"


def _chunk_configs(family: str, op: str, heads: tuple[int, int], shapes, options: dict,
                   strength: float) -> list[BenchConfig]:
    H, HV = heads
    head_name = f"h{H}-hv{HV}" if H != HV else f"h{H}"
    out = []
    for B, T, lengths in shapes:
        total = sum(lengths) if lengths is not None else T
        out.append(BenchConfig(
            op=op, name=f"{family}/{head_name}/{_shape_name(B, T, lengths)}", B=B, T=total, H=H, HV=HV,
            lengths=lengths, options=dict(options), gate_strength=strength,
        ))
    return out


def _decode_configs(family: str, op: str, H: int, HV: int, options: dict) -> list[BenchConfig]:
    return [
        BenchConfig(op=op, name=f"{family}/h{H}-hv{HV}/n{n}", B=n, T=1, H=H, HV=HV,
                    options=dict(options), modes=DECODE_MODES, gate_strength=0.5)
        for n in DECODE_BATCHES
    ]


def build_registry() -> tuple[BenchConfig, ...]:
    """Every config, in run order: GDN, KDA, GLA, Simple GLA, Lightning, then decode."""
    gdn_shapes = ((1, 32768, None), (1, 8192, None), (4, 8192, None), (1, 0, GDN_VARLEN))
    kda_shapes = ((1, 8192, None), (1, 16384, None), (2, 16384, None), (1, 0, KDA_VARLEN))
    long_shapes = ((1, 8192, None), (1, 32768, None))
    configs: list[BenchConfig] = []
    for heads in GDN_HEADS:
        configs += _chunk_configs("gdn", "chunk_gated_delta_rule", heads, gdn_shapes, GDN_OPTIONS, 0.5)
    for h in (64, 96):
        configs += _chunk_configs("kda", "chunk_kda", (h, h), kda_shapes, KDA_OPTIONS, 1.0)
    configs += _chunk_configs("gla", "chunk_gla", (32, 32), long_shapes, PLAIN_OPTIONS, 1.0 / 16)
    configs += _chunk_configs("simple_gla", "chunk_simple_gla", (64, 64), long_shapes, PLAIN_OPTIONS, 1.0)
    configs += _chunk_configs("lightning", "chunk_lightning_attn", (64, 64), long_shapes, LIGHTNING_OPTIONS, 1.0)
    configs += _decode_configs("gdn-decode", "fused_recurrent_gated_delta_rule", 16, 32, GDN_DECODE_OPTIONS)
    configs += _decode_configs("kda-decode", "fused_recurrent_kda", 32, 32, KDA_DECODE_OPTIONS)
    return tuple(configs)


CONFIGS: tuple[BenchConfig, ...] = build_registry()


def get_config(name: str) -> BenchConfig:
    """The config called ``name`` (exact match); raises ``KeyError`` when there is none."""
    for cfg in CONFIGS:
        if cfg.name == name:
            return cfg
    raise KeyError(f"no benchmark config named {name!r}")


def parse_modes(text: str | None) -> tuple[str, ...]:
    """``"fwd,decode"`` -> ``("fwd", "decode")``; None or empty means every mode."""
    if not text:
        return MODES
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; expected a comma-separated subset of {MODES}")
    return modes


def select_configs(configs: Iterable[BenchConfig], filters: str | None = None,
                   modes: Iterable[str] = MODES) -> list[tuple[BenchConfig, tuple[str, ...]]]:
    """Configs whose name contains any of the comma-separated ``filters``, paired with
    the modes to run (the config's modes that are also in ``modes``); configs left with
    no mode are dropped."""
    wanted = [f.strip() for f in (filters or "").split(",") if f.strip()]
    modes = tuple(modes)
    out = []
    for cfg in configs:
        if wanted and not any(w in cfg.name for w in wanted):
            continue
        run_modes = tuple(m for m in cfg.modes if m in modes)
        if run_modes:
            out.append((cfg, run_modes))
    return out


def scale_down(cfg: BenchConfig, tokens: int = 64, max_batch: int = 4) -> BenchConfig:
    """A tiny version of ``cfg`` (about ``tokens`` tokens, same heads and options) for
    CPU tests: varlen mixes keep their shape (every length at least 1)."""
    if cfg.lengths is not None:
        total = sum(cfg.lengths)
        lengths = tuple(max(1, round(n * tokens / total)) for n in cfg.lengths)
        return replace(cfg, lengths=lengths, T=sum(lengths))
    T = cfg.T if cfg.T == 1 else min(cfg.T, tokens)
    return replace(cfg, B=min(cfg.B, max_batch), T=T)
