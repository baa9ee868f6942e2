"""The Triton interpreter's products made to round as a GPU's do, for comparing a kernel's numbers
on the CPU with a GPU run (benchmarks/backward_variants.py, backward_stages.py). Import before any
kernel launches, with TRITON_INTERPRET=1 set.

- ``products(tf32)``: bf16 operands are widened from their bits (the interpreter's own bf16
  product multiplies the raw 16-bit patterns as numbers); with ``tf32``, float32 operands of
  products not asked for in ``ieee`` precision are rounded to tf32 (10 mantissa bits), as the
  GPU's tensor cores take them (the interpreter multiplies in full float32).
- ``bf16_backward()``: the Triton backward's products on bf16 operands and its stored states in
  bf16 for bf16 inputs, as on a GPU (in the interpreter it otherwise picks float32)."""
import numpy as np
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle


def products(tf32: bool) -> None:
    plain = InterpreterBuilder.__dict__.get("_plain_dot", InterpreterBuilder.create_dot)
    InterpreterBuilder._plain_dot = plain

    def operand(x, precision):
        if x.dtype.scalar == tl.bfloat16:
            return TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        if tf32 and x.data.dtype == np.float32 and precision != ir.INPUT_PRECISION.IEEE:
            bits = x.data.view(np.uint32)
            return TensorHandle(((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32), x.dtype)
        return x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return plain(self, operand(a, input_precision), operand(b, input_precision), d, input_precision,
                     max_num_imprecise_acc)
    InterpreterBuilder.create_dot = create_dot


def bf16_backward() -> None:
    from fastla.backends.triton import chunk_delta_backward
    chunk_delta_backward.interpreting = lambda: False
