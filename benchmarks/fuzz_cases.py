"""The training fuzz's cases one process each, for a fault that takes the CUDA context with it
(tests/ops/test_option_fuzz.py::test_triton_backward_against_fp64_on_gpu; docs/notes/
chunk-backward.md: delta seed 7 faulted on an H100).

    python benchmarks/fuzz_cases.py                 # every variant below, CUDA_LAUNCH_BLOCKING=1
    python benchmarks/fuzz_cases.py delta 7 asis    # one case (what each child runs)
    python benchmarks/fuzz_cases.py value-tiles     # seed 7 under the value kernel's tiles, and at K 128

A variant of delta seed 7 changes one thing (contiguous inputs, V 64, no initial state, the
K-first state, allow_neg_eigval off; its forward alone with the chunk states on the Gluon or the
Triton tier, as the training path's forward asks them); the other rows run further seeds as they
are. A row: the variant, its exit status, its last line and, for a failure, the last fastla frames
(with blocking launches, the faulting launch's)."""
import os
import subprocess
import sys

SEED7 = ["fwd-gluon", "fwd-triton", "asis", "contiguous", "v64", "no-h0", "k-first", "no-neg-eigval"]
ROWS = [("delta", 7, v) for v in SEED7] + [("delta", s, "asis") for s in (8, 9, 10, 11)] + \
       [("plain", s, "asis") for s in range(6)]
# the fault's second call (an H100: KDA at K 64, V 32 faults in the value kernel, V 64 passes)
VALUE_TILES = [("delta", 7, v) for v in ("bv16", "warps4", "bv16-warps4", "k128")]


def parent(rows):
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for family, seed, variant in rows:
        r = subprocess.run([sys.executable, __file__, family, str(seed), variant], env=env, capture_output=True,
                           text=True, timeout=150)
        lines = (r.stdout + r.stderr).strip().splitlines()
        print(f"{family} {seed} {variant:14s} rc={r.returncode} {lines[-1][:150] if lines else ''}", flush=True)
        if r.returncode:
            frames = [ln.strip() for ln in lines if ln.strip().startswith("File ") and "/fastla/" in ln]
            print("    " + " <- ".join(fr.split('"')[1].split("/fastla/")[-1] + ":" + fr.split("line ")[1].split(",")[0]
                                      for fr in reversed(frames[-4:])), flush=True)


def child(family: str, seed: int, variant: str):
    import torch

    sys.path.insert(0, os.getcwd())
    import tests.ops.test_option_fuzz as fuzz
    from fastla.backends.triton import chunk_training
    from fastla.core.dispatch import use_tier

    chunk_training.ENABLED = True
    op, t, opts = fuzz.CASES[family](seed, gpu=True)
    if variant.startswith("fwd-"):
        t["g"] = t["g"].float()                       # (the training path's forward gets the gate in fp32)
        with use_tier(variant[4:], strict=True), torch.no_grad():
            out = fuzz.OPS[op](**t, **dict(opts, return_intermediate_states=True))
        torch.cuda.synchronize()
        print("forward ok", [round(x.float().norm().item(), 3) for x in out if x is not None])
        return
    if variant == "contiguous":
        t = {n: x.contiguous() for n, x in t.items()}
    elif variant == "v64":
        t["v"] = torch.randn(*t["v"].shape[:-1], 64, device="cuda").bfloat16()
        t["initial_state"] = torch.randn(*t["initial_state"].shape[:-2], 64, 64, device="cuda")
    elif variant == "no-h0":
        t.pop("initial_state", None)
    elif variant == "k-first":
        opts["state_v_first"] = False
        t["initial_state"] = t["initial_state"].transpose(-1, -2).contiguous()
    elif variant == "no-neg-eigval":
        opts["allow_neg_eigval"] = False
    elif variant in ("bv16", "warps4", "bv16-warps4"):     # the value kernel's tile (its fault at V 32)
        from fastla.backends.triton import chunk_channel_backward as ccb
        ccb.VALUE_BLOCK_V = 16 if "bv16" in variant else ccb.VALUE_BLOCK_V
        ccb.VALUE_WARPS = 4 if "warps4" in variant else ccb.VALUE_WARPS
    elif variant == "k128":
        t = {n: x.contiguous() for n, x in t.items()}
        for n in ("q", "k", "g"):
            t[n] = torch.cat([t[n], t[n]], -1)
        if "initial_state" in t:
            k_axis = -1 if opts["state_v_first"] else -2
            t["initial_state"] = torch.cat([t["initial_state"], t["initial_state"]], k_axis)
    try:
        fuzz.triton_backward_against_fp64(op, t, opts, seed, floor=1e-2)
        print("passed")
    except AssertionError as e:
        print("out of bounds:", str(e)[:140])


if __name__ == "__main__":
    if len(sys.argv) <= 2:
        parent(VALUE_TILES if sys.argv[1:] == ["value-tiles"] else ROWS)
    else:
        child(sys.argv[1], int(sys.argv[2]), sys.argv[3])
