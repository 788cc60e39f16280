"""Launcher helpers shared by the kernel modules (no Triton import here)."""

from __future__ import annotations

import functools

import torch


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (≥ 1): ``tl.arange`` extents must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``(..., H)`` → ``(R, H)`` with a unit stride on the last dim (a view whenever the layout allows)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def require(cond: bool, message: str) -> None:
    """Validate caller input with a real error (never ``assert``: it vanishes under ``python -O``)."""
    if not cond:
        raise ValueError(message)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the tensor's GPU; a nominal 8 on the CPU (interpreter), enough to exercise splits."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


_buffers: dict[tuple, torch.Tensor] = {}


def cached_zeros(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-initialised scratch buffer kept per (tag, device) and grown on demand.

    Used for split-K semaphores that every kernel leaves at zero again when it finishes. Call the kernel once
    before CUDA-graph capture so the buffer is allocated outside the graph; kernels sharing a tag must not run
    concurrently on two streams.
    """
    key = (tag, dtype, device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, 1024), dtype=dtype, device=device)
        _buffers[key] = buf
    return buf


def cached_empty(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Like :func:`cached_zeros` for workspaces that are fully written before they are read."""
    key = ("empty", tag, dtype, device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1024), dtype=dtype, device=device)
        _buffers[key] = buf
    return buf


def min_block(n: int, block: int) -> int:
    """``block`` shrunk to the next power of two ≥ n for small n (no all-masked programs on short rows)."""
    return min(block, next_pow2(n))
