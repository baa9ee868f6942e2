"""Which backward kernel goes wrong on a GPU: the same call with gradients on the GPU and in the
Triton interpreter (CPU), every tensor argument of every backward kernel launch saved after the
launch, then compared launch by launch.

    python benchmarks/backward_stages.py run cuda OP B T DTYPE OUT.pt     # the GPU run
    python benchmarks/backward_stages.py run cpu OP B T DTYPE OUT.pt      # the interpreter (minutes)
    python benchmarks/backward_stages.py compare GPU.pt CPU.pt            # argument by argument

``SAVE_STATES=0``: the backward recomputes the chunk-start states (chunk_training.SAVE_STATES);
``LENGTHS=300,1,64``: a varlen batch of those sequences (B and T ignored).

OP gdn / kda (tests.helpers.gated_case: gate, l2norm and beta sigmoid in the op, KDA's bounded gate,
K = V = 128 (``HEAD_DIM=64``: 64), H = 2, HV = 4); inputs made on the CPU from fixed seeds, so both
runs see the same numbers. The interpreter's backward rounds as the GPU's (bf16 operands, tf32 for
float32 ones: tests/interpreter_emulation.py); the forward differs (Gluon on Hopper, Triton in the
interpreter), so the backward's inputs agree to bf16 rounding; a kernel whose outputs drift further
than its inputs is the suspect. Lines whose relative RMS (over entries finite on both sides) passes
3e-2 are marked."""
import os
import sys

if len(sys.argv) > 2 and sys.argv[1] == "run" and sys.argv[2] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests import interpreter_emulation
    interpreter_emulation.products(tf32=True)

import torch  # noqa: E402


def run(device, op, B, T, dtype, out):
    from fastla.backends.triton import chunk_channel_backward, chunk_delta_backward, chunk_training
    from fastla.core.dispatch import use_tier
    from tests.helpers import OPS, as_leaves, call_chunk, forward_backward, gated_case

    chunk_training.ENABLED = True
    chunk_training.SAVE_STATES = os.environ.get("SAVE_STATES", "1") == "1"
    if device == "cpu":
        from tests import interpreter_emulation
        interpreter_emulation.bf16_backward()
    saved, counts = {}, {}

    def recording(real):
        def launcher(fn, T=None, NT=None):
            inner = real(fn, T, NT)
            name = getattr(getattr(fn, "fn", fn), "__name__", str(fn))
            names = list(getattr(fn, "arg_names", []))

            class Recorded:
                def __getitem__(self, grid):
                    def go(*args, **kwargs):
                        result = inner[grid](*args, **kwargs)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        i = counts[name] = counts.get(name, -1) + 1
                        saved[f"{name}#{i}"] = {
                            (names[j] if j < len(names) else str(j)): a.detach().float().cpu().clone()
                            for j, a in enumerate(args) if isinstance(a, torch.Tensor)}
                        return result
                    return go
            return Recorded()
        return launcher

    for module in (chunk_delta_backward, chunk_channel_backward):
        module.launcher = recording(module.launcher)
    spec = OPS[op]
    D = int(os.environ.get("HEAD_DIM", 128))
    lengths = [int(n) for n in os.environ["LENGTHS"].split(",")] if os.environ.get("LENGTHS") else None
    t, extra, opts = gated_case(op, B=B, T=T, K=D, dtype=dtype, device=device, lengths=lengths, seed=1)
    if lengths:
        B, T = 1, sum(lengths)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(B, T, 4, D, generator=gen).to(device)
    dh = torch.randn(len(lengths) if lengths else B, 4, D, D, generator=gen).to(device)

    def fast(x, **kw):
        with use_tier("triton", strict=True):
            return call_chunk(spec, x, **kw)

    o, ht, grads = forward_backward(fast, as_leaves({**t, **extra}), do, dh, output_final_state=True, **opts)
    saved["grads"] = {n: g.detach().float().cpu() for n, g in grads.items()}
    saved["grads"]["o"] = o.detach().float().cpu()
    torch.save(saved, out)
    print(f"{device}: {len(saved) - 1} launches recorded -> {out}")


def compare(a_path, b_path):
    """One line per launch: each tensor argument's relative RMS between the runs (those past 3e-2
    marked with *), then the gradients'."""
    a, b = torch.load(a_path), torch.load(b_path)
    for key in a:
        if key not in b:
            print(f"{key}: only in {a_path}")
            continue
        parts = []
        for name, x in a[key].items():
            y = b[key].get(name)
            if y is None or x.shape != y.shape or x.numel() <= 1:
                continue
            finite = torch.isfinite(x) & torch.isfinite(y)
            d = (x - y)[finite].double().norm().item()
            n = y[finite].double().norm().item()
            rel = d / n if n > 0 else d
            bad = (~finite).sum().item()
            parts.append(f"{name} {rel:.0e}{'*' if rel > 3e-2 else ''}" + (f" ({bad} non-finite)" if bad else ""))
        print(f"{key}: " + ", ".join(parts))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), getattr(torch, sys.argv[6]), sys.argv[7])
    else:
        compare(sys.argv[2], sys.argv[3])
