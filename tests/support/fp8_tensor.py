"""A small FP8 tensor subclass for tests: uint8 payload + a scale, like Transformer Engine's.

Its nominal dtype is float32. In-place ``copy_`` into it quantizes (as TE's does); every other
op dequantizes and runs on a plain tensor. Loading must never replace or dequantize such a
tensor: it fills it through ``copy_`` and the caller keeps its own object.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


class ScaledFp8Tensor(torch.Tensor):
    @staticmethod
    def __new__(cls, payload: torch.Tensor, scale: float):
        return torch.Tensor._make_wrapper_subclass(
            cls, payload.shape, dtype=torch.float32, device=payload.device
        )

    def __init__(self, payload: torch.Tensor, scale: float):
        self.payload = payload  # uint8 bits of float8_e4m3fn values
        self.scale = scale

    @classmethod
    def quantize(cls, values: torch.Tensor, scale: float) -> ScaledFp8Tensor:
        bits = (values.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return cls(bits.clone(), scale)

    def dequantize(self) -> torch.Tensor:
        return self.payload.view(torch.float8_e4m3fn).float() * self.scale

    def __repr__(self):
        return f"ScaledFp8Tensor(shape={tuple(self.shape)}, scale={self.scale})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and isinstance(args[0], ScaledFp8Tensor):
            dst, src = args[0], args[1]
            if isinstance(src, ScaledFp8Tensor):
                src = src.dequantize()
            dst.payload.copy_((src.float() / dst.scale).to(torch.float8_e4m3fn).view(torch.uint8))
            return dst
        if func is torch.ops.aten.detach.default:
            return args[0]

        def unwrap(t):
            return t.dequantize() if isinstance(t, ScaledFp8Tensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
