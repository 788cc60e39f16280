"""Kernel test helpers (torch only): per-dtype tolerances, poisoned outputs, a verbose comparison.

Shared by the CPU interpreter tests (``tests/unit/kernels``) and the GPU tests (``tests/gpu``). The interpreter
fixes those CPU runs need stay in the package (``kernellab.kernels.testing.patch_interpreter``): the
benchmarks' CPU smoke run calls them too.
"""

from __future__ import annotations

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
