"""The backend description: what an engine asks a backend before it builds caches and metadata.

Vocabulary follows the engines (vLLM's ``AttentionBackend`` class methods), so an engine can
register this backend under the name it already uses, ``FLASHMLA_SPARSE_DSV4``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4attn.device import supported_paths
from dsv4attn.kv_cache.layout import (
    KV_CACHE_DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    FP8DSMLALayout,
    normalize_kv_cache_dtype,
    round_up,
)

#: Engine-facing backend name.
BACKEND_NAME = "FLASHMLA_SPARSE_DSV4"
#: DeepSeek-V4 attention head size and its NoPE/RoPE split (config: head_dim, qk_rope_head_dim).
HEAD_SIZE = 512
ROPE_DIM = 64
NOPE_DIM = HEAD_SIZE - ROPE_DIM
#: Raw tokens per block-table entry (the engines' kernel block size for every DSV4 cache group).
KERNEL_BLOCK_SIZE = 256
MODEL_DTYPES = (torch.bfloat16,)
#: Plain-row pages are aligned to this many bytes (FlashInfer-style bf16 layout).
AUTO_PAGE_ALIGN = 512


@dataclass(frozen=True)
class Capability:
    """What a device can run: kernel paths (fastest first) and why others are missing."""

    device: str
    compute_capability: tuple[int, int] | None
    paths: tuple[str, ...]
    note: str


class DeepseekV4SparseBackend:
    """Static description of the FLASHMLA_SPARSE_DSV4 backend (all class methods)."""

    name = BACKEND_NAME
    is_mla = True
    is_sparse = True
    supports_attn_sink = True
    head_size = HEAD_SIZE
    nope_dim = NOPE_DIM
    rope_dim = ROPE_DIM

    @classmethod
    def get_name(cls) -> str:
        return BACKEND_NAME

    @classmethod
    def get_supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        return MODEL_DTYPES

    @classmethod
    def get_supported_kv_cache_dtypes(cls) -> tuple[str, ...]:
        return KV_CACHE_DTYPES

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int]:
        return [KERNEL_BLOCK_SIZE]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_SIZE]

    @classmethod
    def layout(cls, head_size: int = HEAD_SIZE, rope_dim: int = ROPE_DIM) -> FP8DSMLALayout:
        return FP8DSMLALayout(nope_dim=head_size - rope_dim, rope_dim=rope_dim)

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, int, int]:
        """Logical cache shape: ``(num_blocks, block_size, 584)`` uint8 for fp8_ds_mla (stored with
        a padded block stride, see :func:`page_size_bytes`), ``(num_blocks, block_size, head_size)``
        in the model dtype otherwise. MLA caches have one KV head."""
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("head_size", head_size)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_kv_heads != 1:
            raise ValueError(f"MLA caches have num_kv_heads == 1, got {num_kv_heads}")
        if normalize_kv_cache_dtype(cache_dtype_str, "cache_dtype_str") == "fp8_ds_mla":
            return (num_blocks, block_size, cls.layout(head_size).entry_bytes)
        return (num_blocks, block_size, head_size)

    @classmethod
    def page_size_bytes(cls, block_size: int, head_size: int = HEAD_SIZE, cache_dtype_str: str = "auto") -> int:
        """Bytes of one block (the block stride): 576-aligned for fp8_ds_mla, 512-aligned bf16 rows."""
        if normalize_kv_cache_dtype(cache_dtype_str, "cache_dtype_str") == "fp8_ds_mla":
            return cls.layout(head_size).page_bytes(block_size)
        return round_up(block_size * head_size * 2, AUTO_PAGE_ALIGN)

    @classmethod
    def supports_compute_capability(cls, capability: tuple[int, int]) -> bool:
        """Triton kernels need sm80 or newer (e4m3 is decoded with integer ops, so sm80 works)."""
        return tuple(capability) >= (8, 0)

    @classmethod
    def capability(cls, device: torch.device | str | None = None) -> Capability:
        """Which kernel paths ``device`` can run (default: the current CUDA device, else CPU)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        cc = None
        if device.type == "cuda":
            cc = torch.cuda.get_device_capability(device.index if device.index is not None else None)
        paths = supported_paths(device)
        if "triton" in paths:
            note = "Triton kernels (compiled)" if device.type == "cuda" else "Triton kernels (interpreter)"
        elif device.type == "cuda":
            note = f"compute capability {cc} is below sm80: PyTorch reference only"
        else:
            note = "PyTorch reference only (no CUDA device)"
        return Capability(device=str(device), compute_capability=cc, paths=paths, note=note)

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        block_size: int,
        num_heads: int,
        device: torch.device | str | None = None,
    ) -> list[str]:
        """Reasons this backend cannot serve the configuration (empty list = supported)."""
        reasons = []
        if head_size != HEAD_SIZE:
            reasons.append(f"head_size {head_size} not supported (need {HEAD_SIZE})")
        if dtype not in MODEL_DTYPES:
            reasons.append(f"dtype {dtype} not supported (need one of {MODEL_DTYPES})")
        try:
            normalize_kv_cache_dtype(kv_cache_dtype)
        except (TypeError, ValueError) as e:
            reasons.append(str(e))
        if block_size % KERNEL_BLOCK_SIZE:
            reasons.append(f"block_size {block_size} must be a multiple of {KERNEL_BLOCK_SIZE}")
        if not 1 <= num_heads <= 128:
            reasons.append(f"num_heads {num_heads} must be in [1, 128]")
        if device is not None and torch.device(device).type == "cuda":
            cap = cls.capability(device)
            if "triton" not in cap.paths:
                reasons.append(cap.note)
        return reasons
