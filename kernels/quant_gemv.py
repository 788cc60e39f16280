"""W8A16 and W4A16 decode GEMV (standalone, not dispatched): int8 / int4 weights, one scale per output channel.

Formula
    ``y[m, n] = s[n] · Σ_k x[m, k] · q[n, k]`` with ``q`` the symmetric per-output-channel quantization of W:
    ``s[n] = max_k |W[n, k]| / qmax`` (qmax 127 for int8, 7 for int4), ``q = clamp(round(W / s), -qmax-1, qmax)``.
    Reference: ``ops.linear(x, dequantize_weight(qw))`` (the dequantized weight in fp32).

Storage
    ``quantize_weight(W, bits)`` returns a :class:`QuantizedWeight` holding only the packed weight and the
    scales: int8 stores ``N·K`` bytes, int4 ``N·K/2`` bytes (column ``2j`` in the low nibble of byte ``j``,
    ``2j+1`` in the high nibble, each as ``q + 8``), plus ``4·N`` bytes of fp32 scales. Drop the dense bf16
    weight after quantizing and the layer's memory falls by ~2× (int8) or ~4× (int4); at decode the kernel
    streams that many fewer bytes.

Program mapping, coalescing
    The kernel is ``gemv._gemv_kernel`` with ``W_BITS`` = 8 or 4: identical tiling, split-K and reduction;
    the tile load is int8/uint8 (16 bytes per thread still), converted to fp32 in registers (int4: two
    nibbles → two values, multiplied by the even and odd x elements). The scale multiplies each fp32 partial
    sum once per output, not each weight. Bytes: read ``N·K·bits/8 + 4·N + 2·M·K``, write ``2·M·N``.

Precision
    Products and the K reduction in fp32; no intermediate rounding of the dequantized weight. The quantization
    error itself (up to ``s/2`` per weight) is the model-quality cost: per-channel int4 without groups is
    lossy.

Trade-offs tried
    Group-wise scales (e.g. 128 columns per scale) would lower int4 error at the cost of a scale load per
    group; left for later. Unpacking int4 with a lookup table instead of shifts saves nothing here: the
    kernel waits on memory, not on its ALUs.

Status on the H200 (M = 1)
    The memory saving is real (qweight is N·K or N·K/2 bytes); the speed-up is not yet. At 1–6 MB of packed weight the kernel is latency-bound, not bandwidth-bound, and it runs without PDL, so
    int8 / int4 take 4.9 / 4.5 µs for q/k/v, 3.5 / 3.0 for o, 6.5 / 6.3 for gate/up and 4.3 / 4.4 for down:
    faster than dense cuBLAS at q/k/v (1.1×) and where cuBLAS is weak (o, down: 1.8–4×), slower at gate/up
    (0.9×), and slower than the dense bf16 GEMV with PDL everywhere. Not on the engine path: no loader produces
    these packed weights, and ``kernels="experimental"`` does not reach them (``kernellab.kernels.STANDALONE``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import require
from .gemv import GemvConfig, gemv

__all__ = ["QuantizedWeight", "dequantize_weight", "linear_w4a16", "linear_w8a16", "quantize_weight"]


@dataclass(frozen=True)
class QuantizedWeight:
    """Packed weight (int8 ``(N, K)`` or uint8 ``(N, K/2)``) and fp32 per-output-channel ``scales: (N,)``."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bits: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scales.nbytes


def quantize_weight(weight: torch.Tensor, bits: int = 8) -> QuantizedWeight:
    """Symmetric per-output-channel quantization of ``weight: (N, K)`` to int8 (bits=8) or packed int4 (bits=4)."""
    require(bits in (4, 8), "bits must be 4 or 8")
    require(weight.dim() == 2, "weight must be (N, K)")
    K = weight.shape[1]
    qmax = 127 if bits == 8 else 7
    w = weight.float()
    scales = (w.abs().amax(dim=1) / qmax).clamp(min=1e-12)
    q = torch.clamp(torch.round(w / scales[:, None]), -qmax - 1, qmax).to(torch.int16)
    if bits == 8:
        packed = q.to(torch.int8).contiguous()
    else:
        require(K % 2 == 0, "int4 packing needs an even K")
        u = (q + 8).to(torch.uint8)
        packed = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    return QuantizedWeight(packed, scales.contiguous(), bits, K)


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``(N, K)`` weight that :func:`quantize_weight` approximated (for references and tests)."""
    if qw.bits == 8:
        q = qw.qweight.float()
    else:
        p = qw.qweight.to(torch.int16)
        q = torch.stack([(p & 15) - 8, (p >> 4) - 8], dim=-1).flatten(1).float()
    return (q * qw.scales[:, None]).to(dtype)


def linear_w8a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``x @ (scales[:, None] · qweight).T`` for int8 ``qweight: (N, K)``; ``x: (M ≤ 16, K)`` in bf16/fp16/fp32."""
    require(qweight.dtype == torch.int8, "qweight must be int8")
    return gemv(x, qweight, scales, 8, out, config)


def linear_w4a16(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``x @ dequant(qweight).T`` for packed int4 ``qweight: (N, K/2)`` uint8; ``x: (M ≤ 16, K)``."""
    require(qweight.dtype == torch.uint8, "qweight must be uint8 (two int4 per byte)")
    return gemv(x, qweight, scales, 4, out, config)
