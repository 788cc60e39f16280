"""Fixes for Triton's interpreter (``TRITON_INTERPRET=1``) so CPU runs of the kernels compute what the GPU does.

Called by the CPU interpreter tests (``tests/unit/kernels``, ``tests/unit/runtime``) and the kernel benchmarks'
CPU smoke run (``benchmarks/kernels``), hence in the package; the kernel tests' comparison helpers are in
``tests/support/kernels.py``.
"""

from __future__ import annotations

import numpy as np

_patched = False


def patch_interpreter() -> None:
    """Work around four Triton 3.6 interpreter bugs so CPU runs test what the GPU computes.

    Call before running kernels under ``TRITON_INTERPRET=1`` (the CPU tests' conftest and the CPU smoke run of
    the benchmarks do). Idempotent; patches only the interpreter, never compiled kernels.
    """
    global _patched
    if _patched:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    _patch_scalar_index(interp)
    _patch_bf16_dot(interp, tl.bfloat16, tl.float32)
    _patch_fp8_downcast(interp, tl)
    _patch_int_to_bf16(interp, tl.bfloat16, tl.float32)
    _patched = True


def _patch_scalar_index(interp) -> None:
    """Let ``range(start, n)`` take runtime int arguments under NumPy ≥ 2.4.

    The interpreter passes scalar kernel arguments as 1-element arrays and converts them with ``int(array)``,
    which NumPy 2.4 rejects for 1-D arrays ("only 0-dimensional arrays can be converted"), breaking every loop
    with a runtime bound. Convert through ``.item()`` instead. A no-op where NumPy still accepts it.
    """
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def _patch_bf16_dot(interp, bf16, fp32) -> None:
    """Make ``tl.dot`` on bf16 operands compute instead of multiplying raw bits.

    The interpreter stores bf16 as uint16 and hands those integers straight to ``np.matmul`` (it converts only
    fp8). Convert bf16 operands to fp32 first: products of bf16 values are exact in fp32 and the GPU's
    tensor cores accumulate them in fp32, so this is the same arithmetic.
    """
    builder_cls = type(interp.interpreter_builder)
    original = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar == bf16:
                data = interp._convert_float(h.data, bf16, fp32, None).view(np.float32)
                return interp.TensorHandle(data.reshape(h.data.shape), fp32)
            return h

        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder_cls.create_dot = create_dot


def _patch_fp8_downcast(interp, tl) -> None:
    """Round to float8 e4m3 (``tl.float8e4nv``) to nearest-even, as the GPU's ``cvt.rn.satfinite`` does.

    The interpreter's float downcast adds the first cut-off bit to the kept mantissa without carrying into the
    exponent and without ties-to-even, and truncates subnormals: on a sweep of [-448, 448] plus normal
    samples at three scales, 6,013 of 32,768 values came out wrong, some by half (127.9 → 64 instead of 128).
    Convert through torch's ``float8_e4m3fn`` (round to nearest even) after clamping to the finite range (the
    GPU instruction saturates; torch would give NaN past it). Other conversions keep the interpreter's code.
    """
    import torch

    builder_cls = type(interp.interpreter_builder)
    original = builder_cls.create_fp_to_fp
    fp8, fp32, bf16, fp16 = tl.float8e4nv, tl.float32, tl.bfloat16, tl.float16
    rtz = interp._ir.ROUNDING_MODE.RTZ

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty = src.dtype.scalar
        if dst_type.scalar != fp8 or src_ty not in (fp32, bf16, fp16) or rounding_mode == rtz:
            return original(self, src, dst_type, rounding_mode)
        if src_ty == bf16:
            wide = interp._convert_float(src.data, bf16, fp32, None).view(np.float32)
        else:
            wide = src.data.astype(np.float32)
        x = torch.from_numpy(np.clip(wide, -448.0, 448.0).reshape(src.data.shape))
        bits = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interp.TensorHandle(bits, dst_type.scalar)

    builder_cls.create_fp_to_fp = create_fp_to_fp


def _patch_int_to_bf16(interp, bf16, fp32) -> None:
    """Convert integers to bf16 by value, as the GPU's ``cvt.rn.bf16`` does (the int8 KV cache widens so).

    The interpreter keeps bf16 as uint16 bits and casts integers with ``astype(uint16)``: 15 became the bits
    0x000f (1.4e-39) and negative values NaN. Go through fp32 (exact for the integers involved here) and round
    to bf16 with the interpreter's own fp32 → bf16 conversion.
    """
    builder_cls = type(interp.interpreter_builder)
    original = builder_cls.create_si_to_fp

    def create_si_to_fp(self, src, dst_type):
        if dst_type.scalar != bf16:
            return original(self, src, dst_type)
        wide = src.data.astype(np.float32)
        data = interp._convert_float(wide, fp32, bf16, None).view(np.uint16).reshape(src.data.shape)
        return interp.TensorHandle(data, bf16)

    builder_cls.create_si_to_fp = create_si_to_fp
