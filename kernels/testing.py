"""Test helpers for the kernels (torch only): per-dtype tolerances, poisoned outputs, a verbose comparison.

Shared by the CPU interpreter tests (``tests/unit/kernels``) and the GPU tests (``tests/gpu``).
"""

from __future__ import annotations

import numpy as np
import torch

# (dtype, atol, rtol) for elementwise/normalisation kernels whose only error is the final rounding; kernels
# that round intermediates differently from their reference (tensor-core dots, bf16 probabilities) widen these.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

DTYPE_PARAMS = [(dt, *tol) for dt, tol in TOLERANCES.items()]


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` in place with a value no kernel produces (NaN for floats, the dtype's minimum for ints)."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min)


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return poison(torch.empty(shape, dtype=dtype, device=device))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """``|a - e| ≤ atol + rtol·|e|`` everywhere, NaN never passes; on failure say where and by how much."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype} != expected {expected.dtype}")
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    nan = torch.isnan(a) & ~torch.isnan(e)
    if nan.any():
        idx = nan.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {int(nan.sum())} unwritten/NaN elements, first at {idx}")
    err = (a - e).abs()
    bad = err > atol + rtol * e.abs()
    bad &= ~(torch.isnan(a) & torch.isnan(e))
    if bad.any():
        worst = int(torch.where(bad, err, torch.zeros_like(err)).flatten().argmax())
        at = list(torch.unravel_index(torch.tensor(worst), a.shape))
        at = [int(i) for i in at]
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements off (atol={atol}, rtol={rtol}); worst at {at}: "
            f"got {a.flatten()[worst].item():.6g}, expected {e.flatten()[worst].item():.6g}, "
            f"max abs err {err[~torch.isnan(err)].max().item():.3g}"
        )


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    if torch.isnan(a).any():
        return float("nan")
    return float((a - e).abs().max()) if a.numel() else 0.0


# ------------------------------------------------------------------------------------------------ interpreter


_patched = False


def patch_interpreter() -> None:
    """Work around two Triton 3.6 interpreter bugs so CPU runs test what the GPU computes.

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
