"""One chunked call with gradients through the Triton backward on a GPU, its gradients against the
fp64 reference and the torch tier's (fp32) against the same, under launch switches that separate a
precision loss from a compile's: ``python benchmarks/backward_variants.py OP B T DTYPE TWIN SAVE [IN_OP]``
(OP gdn / kda / gla / simple_gla / lightning, DTYPE bfloat16 / float32, TWIN 0: no length-specialized
twin kernels, SAVE 0: the backward recomputes the chunk states, IN_OP 0: no gate / l2norm / beta
sigmoid in the op, which only GDN and KDA have: tests.helpers.gated_case). K = V = 128
(``HEAD_DIM=64``: 64), H = 2, HV = 4 (where the op has GVA). ``FP32_STATES=1`` in the environment:
the stored chunk states and their gradients in float32; ``DEVICE=cpu``: the Triton interpreter on
the CPU (~2 min at T = 400), with ``TF32=1`` its float32 products' operands rounded to tf32 as the
GPU's are, with ``BF16=1`` the backward's products on bf16 operands and its states in bf16 as on a
GPU (the interpreter's own float32 choice lifted, its bf16 product mended).
``KNOBS=chunk_delta_backward.SCAN_WARPS=4,...``: launch constants of the backward modules;
``SEED``: the inputs' (1)."""
import os, sys, torch
dev = os.environ.get('DEVICE', 'cuda')
if dev == 'cpu':
    os.environ['TRITON_INTERPRET'] = '1'
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import interpreter_emulation
    interpreter_emulation.products(tf32=os.environ.get('TF32') == '1')
from fastla.backends.triton import chunk_delta_backward, chunk_training as ct, launch
from fastla.core.dispatch import use_tier
from tests.helpers import OPS, gated_case, make_inputs, as_leaves, call_chunk, call_reference, forward_backward, rel_rms
ct.ENABLED = True
if dev == 'cpu' and os.environ.get('BF16') == '1':
    interpreter_emulation.bf16_backward()
op, B, T, dt, twin, save = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4]), sys.argv[5] == '1', sys.argv[6] == '1'
inop = len(sys.argv) < 8 or sys.argv[7] == '1'
D = int(os.environ.get('HEAD_DIM', 128))
ct.SAVE_STATES = save
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from backward_profile import apply_knobs  # noqa: E402
apply_knobs()
seed = int(os.environ.get('SEED', 1))
chunk_delta_backward.FP32_STATES = os.environ.get("FP32_STATES") == "1"
if not twin:
    launch.length_specialized = lambda fn: fn
s = OPS[op]
o = dict(output_final_state=True)
ex = {}
if inop and op in ('gdn', 'kda'):
    t, ex, opts = gated_case(op, B=B, T=T, K=D, dtype=dt, device=dev, seed=seed)
    o.update(opts)
else:
    t = make_inputs(s, B=B, T=T, H=2, HV=4 if s.gva else None, K=D, V=D, dtype=dt, device=dev, seed=seed)
torch.manual_seed(0)
do = torch.randn(t['v'].shape, device=dev); dh = torch.randn(B, t['v'].shape[2], D, D, device=dev)
def f(x, **k):
    with use_tier('triton', strict=True):
        return call_chunk(s, x, **k)
def tt(x, **k):
    with use_tier('torch', strict=True):
        return call_chunk(s, x, **k)
a = forward_backward(f, as_leaves({**t, **ex}), do, dh, **o)
r = forward_backward(lambda x, **k: call_reference(s, x, **k), as_leaves({**t, **ex}, torch.float64), do, dh, **o)
c = forward_backward(tt, as_leaves({**t, **ex}), do, dh, **o)
print(' '.join(sys.argv[1:]), os.environ.get('KNOBS', ''), '| vs fp64: o %.1e' % rel_rms(a[0], r[0]), ' '.join('%s %.1e' % (n, rel_rms(g, r[2][n])) for n, g in a[2].items()),
      '| torch tier vs fp64:', ' '.join('%s %.1e' % (n, rel_rms(g, r[2][n])) for n, g in c[2].items()), flush=True)
