"""The Triton interpreter's products made to round as a GPU's do: the bf16 paths of the kernels
checked on the CPU (tests/ops/test_triton_chunk_backward.py), and a kernel's numbers compared with
a GPU run (benchmarks/backward_variants.py, backward_stages.py). With TRITON_INTERPRET=1 set.

- ``products(tf32)``: bf16 operands are widened from their bits (the interpreter's own bf16
  product multiplies the raw 16-bit patterns as numbers); with ``tf32``, float32 operands of
  products not asked for in ``ieee`` precision are rounded to tf32 (10 mantissa bits), as the
  GPU's tensor cores take them (the interpreter multiplies in full float32).
- ``emulated_cast``: float32 to bf16 rounded to nearest even, as a GPU's ``cvt.rn.bf16.f32``
  (the interpreter truncates, a bias that grows through the chunk states: the training fuzz's delta
  seed 7 drew gradients 1.6-3.0e-2 from fp64 with truncation, within the bound with rounding).
- ``bf16_backward()``: the Triton backward's products on bf16 operands and its stored states in
  bf16 for bf16 inputs, as on a GPU (in the interpreter it otherwise picks float32)."""
import numpy as np
import triton.language as tl
from triton._C.libtriton import ir
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle, _get_np_dtype


_PLAIN_DOT = InterpreterBuilder.create_dot
_PLAIN_CAST = InterpreterBuilder.cast_impl


def emulated_dot(tf32: bool):
    """The interpreter's ``create_dot`` with the operands rounded as above (``products`` installs
    it; a test monkeypatches it in)."""

    def operand(x, precision):
        if x.dtype.scalar == tl.bfloat16:
            return TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        if tf32 and x.data.dtype == np.float32 and precision != ir.INPUT_PRECISION.IEEE:
            bits = x.data.view(np.uint32)
            return TensorHandle(((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32), x.dtype)
        return x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _PLAIN_DOT(self, operand(a, input_precision), operand(b, input_precision), d, input_precision,
                     max_num_imprecise_acc)
    return create_dot


def emulated_cast(self, src, dst_type):
    """The interpreter's ``cast_impl`` with float32 to bf16 rounded to nearest even (NaN kept)."""
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return _PLAIN_CAST(self, src, dst_type)
    bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = np.where(np.isnan(src.data), 0x7FC0, rounded).astype(np.uint16)
    return TensorHandle(out.view(_get_np_dtype(dst_type)), dst_type.scalar)


def products(tf32: bool) -> None:
    """The emulated products and casts for the rest of the process."""
    InterpreterBuilder.create_dot = emulated_dot(tf32)
    InterpreterBuilder.cast_impl = emulated_cast


def bf16_backward() -> None:
    from fastla.backends.triton import chunk_delta_backward
    chunk_delta_backward.interpreting = lambda: False
