"""The backend as engines call it: what an engine asks before it builds caches and metadata.

:class:`DeepseekV4SparseBackend` follows vLLM's ``AttentionBackend`` class-method interface
(``get_name``, ``get_builder_cls``, ``get_kv_cache_shape``, ``get_kv_cache_stride_order``,
``is_mla()``, ``is_sparse()``, ``supports_sink()``, ``supports_head_size`` ...,
``validate_configuration``), so an engine can register it under the name it already uses,
``FLASHMLA_SPARSE_DSV4``. :class:`DeepseekV4MetadataBuilder` is its builder class. Every
difference from vLLM's backend and FlashMLA's signatures is listed in docs/compat.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsv4attn._checks import INT32_MAX, check_int
from dsv4attn.device import supported_paths
from dsv4attn.metadata.batch import BatchMetadata
from dsv4attn.metadata.builders import StepMetadata, StepMetadataBuilder
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


class DeepseekV4MetadataBuilder(StepMetadataBuilder):
    """The backend's metadata builder, as engines call one: ``build(common_prefix_len,
    common_attn_metadata)`` once per step, shared by every layer of the step.

    ``common_attn_metadata`` is a :class:`~dsv4attn.metadata.BatchMetadata` (this project's
    validated ``CommonAttentionMetadata``; build it with ``BatchMetadata.from_tensors`` from the
    engine's tensors). Buffers are allocated once in the constructor (CUDA-graph safe).
    """

    def build(  # type: ignore[override]
        self, common_prefix_len: int | BatchMetadata, common_attn_metadata: BatchMetadata | None = None,
        fast_build: bool = False, impl: str = "auto",
    ) -> StepMetadata:
        if isinstance(common_prefix_len, BatchMetadata) and common_attn_metadata is None:
            return super().build(common_prefix_len, impl=impl)
        if isinstance(common_prefix_len, bool) or not isinstance(common_prefix_len, int) or common_prefix_len < 0:
            raise ValueError(f"common_prefix_len must be an int >= 0, got {common_prefix_len!r}")
        if common_prefix_len:
            raise ValueError("common_prefix_len must be 0: cascade attention is not supported by this backend")
        if not isinstance(common_attn_metadata, BatchMetadata):
            raise TypeError(f"common_attn_metadata must be a BatchMetadata, got {type(common_attn_metadata).__name__}")
        return super().build(common_attn_metadata, impl=impl)

    def build_for_cudagraph_capture(self, common_attn_metadata: BatchMetadata) -> StepMetadata:
        """Build for a capture batch (same as ``build``; buffers never move)."""
        return self.build(0, common_attn_metadata)


class DeepseekV4SparseBackend:
    """The FLASHMLA_SPARSE_DSV4 backend: class methods only, as vLLM's ``AttentionBackend``."""

    #: vLLM's class attributes (lists, as vLLM declares them).
    supported_dtypes: list[torch.dtype] = list(MODEL_DTYPES)
    supported_kv_cache_dtypes: list[str] = list(KV_CACHE_DTYPES) + sorted(KV_CACHE_DTYPE_ALIASES)
    accept_output_buffer = True
    forward_includes_kv_cache_update = False
    name = BACKEND_NAME
    head_size = HEAD_SIZE
    nope_dim = NOPE_DIM
    rope_dim = ROPE_DIM

    # ---- names and classes --------------------------------------------------------------------
    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        return (cls.__module__, cls.__qualname__)

    @staticmethod
    def get_builder_cls() -> type[DeepseekV4MetadataBuilder]:
        return DeepseekV4MetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type[StepMetadata]:
        return StepMetadata

    # ---- predicates (vLLM's, callable) ----------------------------------------------------------
    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def is_ssm(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """The reference path and the kernels' fixed split plans give batch-independent rows,
        but it is not tested as a contract: reported False."""
        return False

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == "decoder"

    @classmethod
    def get_supported_dtypes(cls) -> tuple[torch.dtype, ...]:
        return MODEL_DTYPES

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in MODEL_DTYPES

    @classmethod
    def get_supported_kv_cache_dtypes(cls) -> tuple[str, ...]:
        return KV_CACHE_DTYPES

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> bool:
        if kv_cache_dtype is None:
            return True
        try:
            normalize_kv_cache_dtype(kv_cache_dtype)
        except (TypeError, ValueError):
            return False
        return True

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int]:
        return [KERNEL_BLOCK_SIZE]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Engine block sizes that are multiples of the kernel block size (256 raw tokens)."""
        if block_size is None:
            return True
        return isinstance(block_size, int) and block_size > 0 and block_size % KERNEL_BLOCK_SIZE == 0

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int = KERNEL_BLOCK_SIZE) -> int:
        return default_block_size if cls.supports_block_size(default_block_size) else KERNEL_BLOCK_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_SIZE]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size == HEAD_SIZE

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        """Triton kernels need sm80 or newer (e4m3 is decoded with integer ops, so sm80 works).
        ``capability``: ``(major, minor)`` or an object with ``major``/``minor`` (vLLM's)."""
        if hasattr(capability, "major"):
            capability = (capability.major, capability.minor)
        return tuple(capability) >= (8, 0)

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                             block_size: int | None, use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool = False, device_capability: Any = None) -> str | None:
        return None

    # ---- cache geometry ------------------------------------------------------------------------
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
        a padded block stride, see :func:`page_size_bytes`; contiguous blocks are accepted too),
        ``(num_blocks, block_size, head_size)`` in the model dtype otherwise. MLA caches have one
        KV head. ``block_size`` here is the storage block size (entries per block)."""
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size), ("head_size", head_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if num_kv_heads != 1:
            raise ValueError(f"MLA caches have num_kv_heads == 1, got {num_kv_heads}")
        if normalize_kv_cache_dtype(cache_dtype_str, "cache_dtype_str") == "fp8_ds_mla":
            return (num_blocks, block_size, cls.layout(head_size).entry_bytes)
        return (num_blocks, block_size, head_size)

    @classmethod
    def get_kv_cache_block_dim(cls, block_size: int, num_kv_heads: int, head_size: int,
                               cache_dtype_str: str = "auto") -> int:
        return 0

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """Blocks outermost: ``(0, 1, 2)``; with a layers dim, ``(1, 0, 2, 3)`` (blocks first
        physically, so pages are read by the runtime block stride)."""
        return (1, 0, 2, 3) if include_num_layers_dimension else (0, 1, 2)

    @classmethod
    def indexes_kv_by_block_stride(cls) -> bool:
        return True

    @classmethod
    def page_size_bytes(cls, block_size: int, head_size: int = HEAD_SIZE, cache_dtype_str: str = "auto") -> int:
        """Bytes of one block (the block stride): 576-aligned for fp8_ds_mla, 512-aligned bf16 rows."""
        check_int("block_size", block_size, 1, INT32_MAX)
        check_int("head_size", head_size, 1, INT32_MAX)
        if normalize_kv_cache_dtype(cache_dtype_str, "cache_dtype_str") == "fp8_ds_mla":
            return cls.layout(head_size).page_bytes(block_size)
        return round_up(block_size * head_size * 2, AUTO_PAGE_ALIGN)

    # ---- capability and configuration ----------------------------------------------------------
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
        kv_cache_dtype: str | None,
        block_size: int | None,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        **engine_flags: Any,
    ) -> list[str]:
        """Reasons this backend cannot serve the configuration (empty list = supported).

        Positional form of this project: ``(head_size, dtype, kv_cache_dtype, block_size,
        num_heads, device)``. vLLM's keyword flags are accepted too (``use_mla``, ``has_sink``,
        ``use_sparse``, ``use_mm_prefix``, ``use_per_head_quant_scales``, ``device_capability``,
        ``attn_type``, ``use_non_causal``, ``use_batch_invariant``, ``use_kv_connector``).
        """
        reasons = []
        if not cls.supports_head_size(head_size):
            reasons.append(f"head_size {head_size} not supported (need {HEAD_SIZE})")
        if not cls.supports_dtype(dtype):
            reasons.append(f"dtype {dtype} not supported (need one of {MODEL_DTYPES})")
        if kv_cache_dtype is not None:
            try:
                normalize_kv_cache_dtype(kv_cache_dtype)
            except (TypeError, ValueError) as e:
                reasons.append(str(e))
        if not cls.supports_block_size(block_size):
            reasons.append(f"block_size {block_size} must be a multiple of {KERNEL_BLOCK_SIZE}")
        if num_heads is not None and not (isinstance(num_heads, int) and 1 <= num_heads <= 128):
            reasons.append(f"num_heads {num_heads} must be in [1, 128]")
        if device is not None and torch.device(device).type == "cuda":
            cap = cls.capability(device)
            if "triton" not in cap.paths:
                reasons.append(cap.note)
        flags = dict(engine_flags)
        unknown = set(flags) - {"use_mla", "has_sink", "use_sparse", "use_mm_prefix", "use_per_head_quant_scales",
                                "device_capability", "attn_type", "use_non_causal", "use_batch_invariant",
                                "use_kv_connector"}
        if unknown:
            raise TypeError(f"validate_configuration got unknown keyword(s) {sorted(unknown)}")
        if "use_mla" in flags and not flags["use_mla"]:
            reasons.append("non-MLA not supported")
        if "use_sparse" in flags and not flags["use_sparse"]:
            reasons.append("non-sparse not supported")
        for flag, pred, what in (("use_mm_prefix", cls.supports_mm_prefix, "partial multimodal prefix"),
                                 ("use_per_head_quant_scales", cls.supports_per_head_quant_scales,
                                  "per-head quant scales"),
                                 ("use_non_causal", cls.supports_non_causal, "non-causal attention"),
                                 ("use_batch_invariant", cls.supports_batch_invariance, "batch invariance"),
                                 ("use_kv_connector", cls.supports_kv_connector, "KV connector")):
            if flags.get(flag) and not pred():
                reasons.append(f"{what} not supported")
        dev_cap = flags.get("device_capability")
        if dev_cap is not None and not cls.supports_compute_capability(dev_cap):
            reasons.append("compute capability not supported (need sm80+)")
        if "attn_type" in flags and not cls.supports_attn_type(flags["attn_type"]):
            reasons.append(f"attention type {flags['attn_type']} not supported")
        return reasons
