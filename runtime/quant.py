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

GGUF_BLOCK = 32  # weights per block, in Q4_1 and Q8_0 alike
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of codes


def q4_1_unpack(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF Q4_1 bytes → ``(codes (N, K) uint8 in 0…15, d (N, K/32) fp32, m (N, K/32) fp32)``.

    Within a block the low nibbles of the 16 code bytes are weights 0…15 and the high nibbles 16…31."""
    n, k = shape
    if k % GGUF_BLOCK:
        raise ValueError(f"Q4_1 rows must be a multiple of {GGUF_BLOCK} long, got {k}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GGUF_BLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return codes, d, m


def q4_1_dequantize(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    n, k = codes.shape
    g = codes.reshape(n, k // GGUF_BLOCK, GGUF_BLOCK).astype(np.float32)
    return (g * d[..., None] + m[..., None]).reshape(n, k)


Q8_0_BYTES = 34  # fp16 d, 32 int8 codes


def q8_0_unpack(raw: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q8_0 bytes → ``(codes (N, K) int8, d (N, K/32) fp32)``; the weight is ``d·q``."""
    n, k = shape
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GGUF_BLOCK, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return codes, d


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
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(codes.astype(np.int32)), 1)
        scale = torch.from_numpy(d)
        zero = torch.from_numpy(m + 8.0 * d)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, sz, GGUF_BLOCK, n)

    def to(self, dtype: torch.dtype) -> Int4Weight:
        self.scale_zero = self.scale_zero_f32.to(dtype)
        return self

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zero)


class Int4Pair:
    """A Q8_0 weight as the sum of two int4 weights, exactly: with ``q = 16·hi + lo`` (``lo = q & 15`` in 0…15,
    ``hi = q >> 4`` in −8…7), ``d·q = d·lo + 16d·hi``; ``lo`` is codes ``lo`` with scale d and zero 8d, ``hi`` is
    codes ``hi + 8`` with scale 16d and zero 0. Two 4-bit reads are still half the bytes of bf16 (the LM head)."""

    def __init__(self, lo: Int4Weight, hi: Int4Weight):
        self.lo, self.hi = lo, hi
        self.out_features = lo.out_features

    @classmethod
    def from_q8_0(cls, codes: np.ndarray, d: np.ndarray) -> Int4Pair:
        q = codes.astype(np.int16)
        lo, hi = q & 15, (q >> 4) + 8
        return cls(Int4Weight.from_q4_1(lo, d, np.zeros_like(d)), Int4Weight.from_q4_1(hi, 16.0 * d, -128.0 * d))

    def to(self, dtype: torch.dtype) -> Int4Pair:
        self.lo.to(dtype)
        self.hi.to(dtype)
        return self

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.lo.mm(x) + self.hi.mm(x)


def fuse_rows(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
    """Stack the shards of a fused projection (q, k, v or gate, up) along the output rows, array by array."""
    return tuple(np.concatenate([p[i] for p in parts], axis=0) for i in range(len(parts[0])))
