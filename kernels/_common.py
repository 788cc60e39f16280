"""Launcher helpers shared by the kernel modules (no Triton import here)."""

from __future__ import annotations

import contextlib
import functools
import os

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


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def supports_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs Hopper (sm_90) or newer."""
    if device.type != "cuda":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


_PDL = {"on": os.environ.get("KERNELLAB_PDL", "1") != "0"}


def use_pdl(t: torch.Tensor) -> bool:
    """Launch with programmatic dependent launch (PDL): on Hopper or newer, unless turned off
    (``KERNELLAB_PDL=0``, or inside ``pdl(False)``). Read at launch time, so a CUDA graph keeps what was in force
    when it was captured.

    A PDL kernel starts with ``griddepcontrol.launch_dependents`` (the next PDL kernel in the stream may be
    scheduled now) and ``griddepcontrol.wait`` (returns once the previous grid has completed and its writes are
    visible) before it touches memory the previous kernel writes; a GEMV issues its weight loads in between.
    A chain of such kernels overlaps each launch and ramp-up with the tail of the kernel before it."""
    return _PDL["on"] and t.is_cuda and supports_pdl(t.device)


@contextlib.contextmanager
def pdl(enabled: bool):
    """Turn PDL on or off for the launches (and graph captures) inside the block: the gate's A/B of it."""
    before, _PDL["on"] = _PDL["on"], enabled
    try:
        yield
    finally:
        _PDL["on"] = before


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
