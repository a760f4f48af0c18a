"""Block fp8 (e4m3) of the activations a dispatch may send: one float32 scale per 128 elements
of a row, DeepEP's layout. Used by the DeepEP backends and by copy_engine's fp8 dispatch."""

from __future__ import annotations

import torch

__all__ = ["FP8_BLOCK", "FP8_MAX", "FP8_DISPATCH_BYTES", "quantize_fp8_blocks", "dequantize_fp8_blocks"]

#: elements per scale
FP8_BLOCK = 128
#: the largest finite float8_e4m3fn
FP8_MAX = 448.0
#: bytes an element of an fp8 dispatch moves: the byte and its share of the block's scale
FP8_DISPATCH_BYTES = 1 + 4 / FP8_BLOCK


def quantize_fp8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-element block fp8 quantization, the layout DeepEP dispatches.

    Args:
        x: ``[M, H]`` bf16/fp32 with ``H % 128 == 0``.

    Returns:
        ``(q, scales)``: ``q`` ``[M, H]`` ``torch.float8_e4m3fn``; ``scales`` ``[M, H // 128]``
        float32 with ``x ~= q * scales`` block-wise.
    """
    m, h = x.shape
    if h % FP8_BLOCK:
        raise ValueError(f"fp8 block quantization needs hidden % {FP8_BLOCK} == 0, got {h}")
    blocks = x.float().view(m, h // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / FP8_MAX
    q = (blocks / scales.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, h), scales.contiguous()


def dequantize_fp8_blocks(q: torch.Tensor, scales: torch.Tensor,
                          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blocks`: ``q`` ``[..., H]``, ``scales`` ``[..., H // 128]``
    (any strides) -> ``[..., H]`` in ``dtype``."""
    h = q.shape[-1]
    blocks = q.float().reshape(*q.shape[:-1], h // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales.float().unsqueeze(-1)).reshape(q.shape).to(dtype)
