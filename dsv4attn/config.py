"""Configuration of the DeepSeek-V4 attention layers: frozen dataclasses, validated on creation.

``AttentionConfig.from_hf`` reads a Hugging Face ``DeepseekV4Config`` (or any object with the
same attribute names). Layer kinds and their compression ratios:

- ``"sliding"``: sliding-window attention only (HF ``sliding_attention``, ``compress_ratios`` 0),
  ratio 1, RoPE "main" (``rope_theta``, never scaled);
- ``"csa"``: compressed sparse attention (HF ``compressed_sparse_attention``), ratio
  ``compress_rates["compressed_sparse_attention"]`` (4 in the released models), overlapping
  compressor windows and the lightning indexer, RoPE "compress";
- ``"hca"``: heavily compressed attention (HF ``heavily_compressed_attention``), ratio
  ``compress_rates["heavily_compressed_attention"]`` (128), non-overlapping windows, RoPE
  "compress".

RoPE "compress" uses ``compress_rope_theta`` with the configured scaling (YaRN in the released
checkpoints, ``attention_factor`` 1.0 unless the config sets it), exactly as the reference
model chooses per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4attn._checks import check_float, check_int

#: Layer kinds, in the order of the HF names below.
LAYER_KINDS = ("sliding", "csa", "hca")
#: HF ``layer_types`` value -> our layer kind.
HF_LAYER_TYPE_TO_KIND = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
#: Legacy per-layer ``compress_ratios`` value -> HF layer type (as in the HF config).
_LEGACY_RATIO_TO_HF_TYPE = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
#: RoPE types we implement (those the released checkpoints use).
ROPE_TYPES = ("default", "yarn")


def _positive_int(name: str, value: object) -> None:
    check_int(name, value)
    if value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table: interleaved (GPT-J) RoPE over the last ``rope_dim`` channels.

    ``rope_type`` "default": ``inv_freq[i] = theta ** (-2i / rope_dim)``. "yarn": the YaRN blend
    of interpolated (``/ factor``) and extrapolated frequencies over the correction range given
    by ``beta_fast``/``beta_slow`` and ``original_max_position_embeddings`` (range truncated to
    integers, as the reference always does). cos/sin are multiplied by ``attention_factor``
    (1.0 for "default"; for YaRN the HF config injects 1.0, the V4 reference never scales).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        check_float("theta", self.theta, positive=True)
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            check_float(name, getattr(self, name))
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "yarn":
            if not self.factor > 0:
                raise ValueError(f"yarn factor must be > 0, got {self.factor!r}")
            _positive_int("original_max_position_embeddings", self.original_max_position_embeddings)

    def inv_freq(self, rope_dim: int) -> torch.Tensor:
        """``[rope_dim // 2]`` fp32 inverse frequencies (CPU), one per interleaved pair."""
        exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
        pos_freqs = float(self.theta) ** exponents
        extrapolated = 1.0 / pos_freqs
        if self.rope_type == "default":
            return extrapolated
        interpolated = 1.0 / (self.factor * pos_freqs)
        orig = self.original_max_position_embeddings
        assert orig is not None  # checked in __post_init__ for yarn

        def correction_dim(num_rotations: float) -> float:
            return (rope_dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high: float = min(math.ceil(correction_dim(self.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp (same guard as the YaRN reference)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation_weight = 1 - ramp
        return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight

    @staticmethod
    def from_hf_params(params: dict[str, Any]) -> "RopeConfig":
        """Build from one HF ``rope_parameters`` sub-dict (``main`` or ``compress``)."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params["rope_theta"]
        if rope_type == "default":
            return RopeConfig(theta=float(theta))
        if rope_type != "yarn":
            raise ValueError(f"rope_parameters rope_type {rope_type!r} is not supported; use one of {ROPE_TYPES}")
        factor = params.get("factor")
        if factor is None:
            raise ValueError("yarn rope_parameters need 'factor'")
        attention_factor = params.get("attention_factor")
        if attention_factor is None:  # YaRN's default mscale (the HF config normally injects 1.0)
            mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if mscale and mscale_all:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            else:
                attention_factor = get_mscale(factor)
        return RopeConfig(
            theta=float(theta),
            rope_type="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=float(attention_factor),
        )


@dataclass(frozen=True)
class AttentionConfig:
    """Dimensions and per-layer schedule of DeepSeek-V4 attention (all layers of one model).

    ``layer_kinds[i]`` is "sliding" | "csa" | "hca"; ``compress_ratios[i]`` is 1 for "sliding"
    and the compression ratio (>= 2) otherwise. ``head_dim = nope + rope_dim`` (the RoPE part
    is the LAST ``rope_dim`` channels). The indexer fields only matter for "csa" layers.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    index_num_heads: int
    index_head_dim: int
    index_topk: int
    layer_kinds: tuple[str, ...]
    compress_ratios: tuple[int, ...]
    main_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=10000.0))
    compress_rope: RopeConfig = field(default_factory=lambda: RopeConfig(theta=160000.0))
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1 << 20

    def __post_init__(self) -> None:
        for name in (
            "hidden_size", "num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank",
            "window_size", "index_num_heads", "index_head_dim", "index_topk", "max_position_embeddings",
        ):
            _positive_int(name, getattr(self, name))
        for name in ("layer_kinds", "compress_ratios"):
            if isinstance(getattr(self, name), (str, bytes)) or not hasattr(getattr(self, name), "__iter__"):
                raise TypeError(f"{name} must be a sequence, got {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for i, r in enumerate(self.compress_ratios):
            check_int(f"compress_ratios[{i}]", r)
        if self.rope_dim % 2 or self.rope_dim >= self.head_dim:
            raise ValueError(f"rope_dim must be even and < head_dim={self.head_dim}, got {self.rope_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            # The grouped output projection splits the H * D attention output into o_groups equal
            # parts (as the reference does); heads need not divide evenly.
            raise ValueError(f"num_heads * head_dim = {self.num_heads * self.head_dim} must be divisible by "
                             f"o_groups={self.o_groups}")
        if not self.layer_kinds or len(self.layer_kinds) != len(self.compress_ratios):
            raise ValueError(
                f"layer_kinds ({len(self.layer_kinds)}) and compress_ratios ({len(self.compress_ratios)}) "
                "must be non-empty and of equal length"
            )
        for i, (kind, ratio) in enumerate(zip(self.layer_kinds, self.compress_ratios)):
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer_kinds[{i}] must be one of {LAYER_KINDS}, got {kind!r}")
            if (kind == "sliding") != (ratio == 1) or ratio < 1:
                raise ValueError(f"layer {i}: kind {kind!r} needs ratio 1 iff sliding (ratio >= 2 otherwise), got {ratio}")
        if "csa" in self.layer_kinds and self.index_head_dim <= self.rope_dim:
            raise ValueError(f"index_head_dim={self.index_head_dim} must exceed rope_dim={self.rope_dim}")
        check_float("rms_norm_eps", self.rms_norm_eps, positive=True)
        for name in ("main_rope", "compress_rope"):
            if not isinstance(getattr(self, name), RopeConfig):
                raise TypeError(f"{name} must be a RopeConfig, got {type(getattr(self, name)).__name__}")

    # ---- derived --------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def softmax_scale(self) -> float:
        """``head_dim ** -0.5`` (no YaRN mscale)."""
        return self.head_dim ** -0.5

    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers}), got {layer_idx!r}")

    def layer_kind(self, layer_idx: int) -> str:
        self._check_layer(layer_idx)
        return self.layer_kinds[layer_idx]

    def compress_ratio(self, layer_idx: int) -> int:
        self._check_layer(layer_idx)
        return self.compress_ratios[layer_idx]

    def rope(self, layer_idx: int) -> RopeConfig:
        """The rotary table of a layer: "main" for sliding layers, "compress" otherwise."""
        return self.main_rope if self.layer_kind(layer_idx) == "sliding" else self.compress_rope

    # ---- HF bridge ------------------------------------------------------------------------
    @staticmethod
    def from_hf(hf_config: Any) -> "AttentionConfig":
        """Read a HF ``DeepseekV4Config`` (transformers >= 5.17), a ``config.json`` dict, or any
        object with the same fields. Missing required fields raise ``ValueError`` naming them.

        Layer schedule: ``layer_types`` with ``compress_rates`` if present, else the legacy
        per-layer ``compress_ratios`` (0 -> sliding). RoPE: ``rope_parameters["main"]`` and
        ``["compress"]`` when nested, else built from ``rope_theta`` / ``compress_rope_theta``
        (+ the flat scaling keys for the compress table, as the HF config does).
        """
        get: Any
        if isinstance(hf_config, dict):
            get = hf_config.get
        else:
            get = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        required = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "num_hidden_layers")
        missing = [k for k in required if get(k) is None]
        if missing:
            raise ValueError(f"hf_config lacks required field(s) {missing}")
        head_dim = get("head_dim")
        rope_dim = get("qk_rope_head_dim")
        if rope_dim is None:
            prf = get("partial_rotary_factor") or 64 / 512
            rope_dim = int(head_dim * prf)
        n = get("num_hidden_layers")
        layer_types = get("layer_types")
        rates = dict(get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
        if layer_types is None:
            legacy = get("compress_ratios")
            if legacy is None:
                raise ValueError("hf_config has neither layer_types nor compress_ratios")
            layer_types = [_LEGACY_RATIO_TO_HF_TYPE[int(r)] for r in legacy]
        layer_types = list(layer_types)[:n]
        kinds, ratios = [], []
        for i, t in enumerate(layer_types):
            if t not in HF_LAYER_TYPE_TO_KIND:
                raise ValueError(f"hf_config.layer_types[{i}] = {t!r} is not a DeepSeek-V4 attention type")
            kinds.append(HF_LAYER_TYPE_TO_KIND[t])
            ratios.append(1 if t == "sliding_attention" else int(rates[t]))
        rp = get("rope_parameters") or get("rope_scaling") or {}  # config.json files carry rope_scaling
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main_rope = RopeConfig.from_hf_params(rp["main"])
            compress_rope = RopeConfig.from_hf_params(rp["compress"])
        else:
            main_rope = RopeConfig(theta=float(get("rope_theta", 10000.0)))
            flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            flat["rope_theta"] = get("compress_rope_theta", 160000.0)
            if flat.get("rope_type", flat.get("type", "default")) == "yarn":
                flat.setdefault("attention_factor", 1.0)
            compress_rope = RopeConfig.from_hf_params(flat)
        return AttentionConfig(
            hidden_size=int(get("hidden_size")),
            num_heads=int(get("num_attention_heads")),
            head_dim=int(head_dim),
            rope_dim=int(rope_dim),
            q_lora_rank=int(get("q_lora_rank")),
            o_groups=int(get("o_groups")),
            o_lora_rank=int(get("o_lora_rank")),
            window_size=int(get("sliding_window")),
            index_num_heads=int(get("index_n_heads")),
            index_head_dim=int(get("index_head_dim")),
            index_topk=int(get("index_topk")),
            layer_kinds=tuple(kinds),
            compress_ratios=tuple(ratios),
            main_rope=main_rope,
            compress_rope=compress_rope,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(get("max_position_embeddings", 1 << 20)),
        )
