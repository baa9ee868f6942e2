"""Forward + backward of one chunked call on a GPU, the Triton backward against the torch tier's
(autograd through the chunked PyTorch algorithm), eager, wall time between synchronizations:
``python benchmarks/backward_time.py OP B T H HV`` (OP gdn / kda; K = V = 128, bf16, gate, l2norm
and beta sigmoid in the op, an initial state). Prints the median of five calls per path, ms."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastla.backends.triton import chunk_training  # noqa: E402
from tests.helpers import OPS, make_inputs  # noqa: E402


def main(op, B, T, H, HV):
    spec = OPS[op]
    t = make_inputs(spec, B=B, T=T, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, seed=0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    t = {n: x.to(dev) for n, x in t.items()}
    extra = {"A_log": torch.randn(HV, device=dev), "dt_bias": torch.randn(HV * (128 if op == "kda" else 1), device=dev)}
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                output_final_state=True, **extra)
    if op == "kda":
        opts.update(safe_gate=True, lower_bound=-5.0)
    do = torch.randn(B, T, HV, 128, device=dev, dtype=torch.bfloat16)
    leaves = {n: x.detach().requires_grad_(n in ("q", "k", "v", "g", "beta", "initial_state")) for n, x in t.items()}

    def step():
        o, ht = spec.chunk(**leaves, **opts)[:2]
        (o.float() * do.float()).sum().add(ht.sum()).backward()

    for enabled in ((True, False) if dev == "cuda" else (False,)):     # (no Triton tier on the CPU)
        chunk_training.ENABLED = enabled
        for _ in range(2):
            step()
        times = []
        for _ in range(5):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(1e3 * (time.perf_counter() - start))
        print(f"{op} B{B} T{T} H{H} HV{HV} fwd+bwd, {'Triton backward' if enabled else 'torch tier'}: "
              f"{sorted(times)[2]:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]))
