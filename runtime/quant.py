"""Weight-only int4 for CPU decode: a GGUF Q4_1 tensor kept in its own 4-bit codes instead of dequantized.

Q4_1 stores each row in blocks of 32 weights: an fp16 scale ``d``, an fp16 minimum ``m`` and 32 four-bit codes
``q``; the weight is ``d·q + m``. PyTorch's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``) computes with
``(q − 8)·scale + zero`` per group, so ``scale = d`` and ``zero = m + 8·d`` describe the same weights: the repack
is exact (in fp32; in bf16 the scale and zero are rounded once, as the dense bf16 weights are).

Why: one decode step of a small model on a CPU reads every weight once, so it is bound by memory traffic. Four
bits a weight instead of sixteen is what llama.cpp does with this file, and it is what a batch-1 decode needs;
for many rows at once (prefill, large decode batches) the dense matmul is faster, so ``Int4Weight`` serves
only steps with few rows (``max_rows``) and the dense weight stays for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

Q4_1_BLOCK = 32  # weights per block
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes


def q4_1_unpack(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 bytes → ``(codes (N, K) uint8 in 0…15, d (N, K/32) fp32, m (N, K/32) fp32)``.

    Within a block the low nibbles of the 16 code bytes are weights 0…15 and the high nibbles 16…31."""
    n, k = shape
    if k % Q4_1_BLOCK:
        raise ValueError(f"Q4_1 rows must be a multiple of {Q4_1_BLOCK} long, got {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // Q4_1_BLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return codes, d, m


def q4_1_dequantize(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    n, k = codes.shape
    g = codes.reshape(n, k // Q4_1_BLOCK, Q4_1_BLOCK).astype(np.float32)
    return (g * d[..., None] + m[..., None]).reshape(n, k)


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


@dataclass
class Int4Weight:
    """One (possibly fused) linear's weight as int4 codes with per-group scale and zero, in PyTorch's CPU
    int4pack layout. ``mm(x)`` = ``x @ W^T`` for ``x: (M, K)`` in the dtype given to ``to``."""

    packed: torch.Tensor
    scale_zero_f32: torch.Tensor  # (K/G, N, 2): per group, per output row, (scale, zero)
    group: int
    out_features: int
    scale_zero: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.scale_zero = self.scale_zero_f32

    @classmethod
    def from_q4_1(cls, codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> Int4Weight:
        n = codes.shape[0]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(codes.astype(np.int32)), 1
        )
        scale = torch.from_numpy(d)
        zero = torch.from_numpy(m + 8.0 * d)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, sz, Q4_1_BLOCK, n)

    def to(self, dtype: torch.dtype) -> Int4Weight:
        self.scale_zero = self.scale_zero_f32.to(dtype)
        return self

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zero)


def fuse_q4_1(
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack the shards of a fused projection (q, k, v or gate, up) along the output rows."""
    return tuple(np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
