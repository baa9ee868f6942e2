"""The op's activations as Triton device functions, one definition each: the gates computed in the
op and beta's sigmoid (their PyTorch forms and conventions: fastla/core/gates.py), and the modes
as the kernels number them. Called by the decode kernels (recurrent.py and, inlined,
gluon/recurrent_sm90.py), the chunked prologues (chunk_prepare.py, chunk_prepare_kda.py and, for
GDN, gluon/chunk_inverse_sm90.py) and the training path's gate kernels (gate_grads.py). The sm_90
KDA prologue and the gaters of its scan form KDA's gate on approximate MUFU ops of their own
(gluon/chunk_prepare_kda_sm90.py, gluon/chunk_delta_regs_sm90.py), measured against these.

With x = g_raw + dt_bias (the bias optional) and a = e^A_log (1 without A_log, bounded gate only):
    softplus gate (GDN; KDA without lower_bound):  -a softplus(x)        d/dx: -a sigmoid(x)
    bounded gate (KDA with lower_bound):            lb sigmoid(a x)       d/dx: lb s (1 - s) a
"""
import triton
import triton.language as tl

# The gate computed in the op (GATE): none (given or absent), GDN's, KDA's softplus one, KDA's
# bounded one
GATE_NONE, GATE_GDN, GATE_KDA, GATE_KDA_BOUNDED = 0, 1, 2, 3
# beta (BETA): absent (ones), given, sigmoid, 2 x sigmoid (allow_neg_eigval)
BETA_ONE, BETA_GIVEN, BETA_SIGMOID, BETA_SIGMOID2 = 0, 1, 2, 3

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def softplus(x):
    """log(1 + e^x), x itself above 20 (where e^x would lose it)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def log_decay(x, a, lower_bound, BOUNDED: tl.constexpr):
    """The log decay of the gate computed in the op: lower_bound sigmoid(a x) (BOUNDED) or
    -a softplus(x)."""
    if BOUNDED:
        return lower_bound * tl.sigmoid(a * x)
    return -a * softplus(x)


@triton.jit
def log2_decay(x, a, lower_bound, BOUNDED: tl.constexpr):
    """``log_decay`` times log2(e), on exp2 / log2 (the chunked prologue's base-2 cumsums)."""
    if BOUNDED:
        return (LOG2E * lower_bound) / (1.0 + tl.exp2(-LOG2E * a * x))
    return -a * tl.where(x > 20.0, LOG2E * x, tl.log2(1.0 + tl.exp2(LOG2E * x)))


@triton.jit
def log_decay_dx(x, a, lower_bound, BOUNDED: tl.constexpr):
    """d log_decay / dx."""
    if BOUNDED:
        s = tl.sigmoid(a * x)
        return lower_bound * s * (1.0 - s) * a
    return -a * tl.sigmoid(x)


@triton.jit
def activate_beta(b, BETA: tl.constexpr):
    """beta as the op defines it (BETA_GIVEN: as given; BETA_SIGMOID: sigmoid; BETA_SIGMOID2:
    2 x sigmoid), float32."""
    b = b.to(tl.float32)
    if BETA >= 2:
        b = tl.sigmoid(b)
    if BETA == 3:
        b = 2.0 * b
    return b
