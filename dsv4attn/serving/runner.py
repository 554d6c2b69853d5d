"""AttentionRunner: one attention layer serving many requests over its own paged caches.

A convenience client of :class:`dsv4attn.serving.engine.PagedAttentionEngine` with one layer:
``step(chunks)`` runs one batch (every request's new hidden rows, any mix of first chunks,
later chunks and decode tokens) as ``begin_step`` / ``run_layer(0)`` / ``end_step``. There is
no second copy of the step logic: the model wrapper runs the same engine over all its layers.

Errors (``ValueError``/``TypeError``/``KeyError``/``PoolExhaustedError``) are raised before any
state changes, so a bad request never disturbs the others' caches.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch

from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.serving.engine import KV_CACHE_DTYPES, PAGED_RATIOS, PagedAttentionEngine

__all__ = ["AttentionRunner", "KV_CACHE_DTYPES", "PAGED_RATIOS"]


def check_chunks(chunks: object, hidden_size: int, dtype: torch.dtype, device: torch.device) -> dict[Hashable, int]:
    """A layer step's input ``{request id: hidden [n, hidden_size]}`` (n >= 1, ``dtype`` on
    ``device``) -> ``{request id: n}``; ``TypeError`` / ``ValueError`` naming the request."""
    if not isinstance(chunks, Mapping):
        raise TypeError(f"chunks must be a dict request_id -> hidden states, got {type(chunks).__name__}")
    counts = {}
    for rid, x in chunks.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"chunks[{rid!r}] must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != hidden_size:
            raise ValueError(f"chunks[{rid!r}] must be [n, {hidden_size}], got shape {tuple(x.shape)}")
        if x.shape[0] == 0:
            raise ValueError(f"chunks[{rid!r}] is empty: every request in a step needs >= 1 token")
        if x.dtype != dtype or x.device != device:
            raise ValueError(f"chunks[{rid!r}] must be {dtype} on {device}, got {x.dtype} on {x.device}")
        counts[rid] = int(x.shape[0])
    return counts


class AttentionRunner:
    """Runs ``layer`` for many requests at once over paged caches.

    Args:
        layer: a ``DeepseekV4Attention`` (its parameter dtype is the compute dtype).
        kv_cache_dtype: "auto" (cache rows in the layer's dtype) or "fp8_ds_mla".
        num_blocks: blocks of the context-sized cache group (256-token columns of the compressed
            caches; the SWA group of a sliding layer); ``None``: sized by the engine's defaults.
            Window-bounded groups are sized by the engine (see :class:`PagedAttentionEngine`).
        device: where caches and compute live (default: the layer's device).
        max_num_batched_tokens / max_num_reqs: per-step / live-request limits; max_model_len:
            per-request limit. impl: kernel path of every op ("auto" | "triton" | "reference").
        deterministic: batch-invariant attention (see :class:`PagedAttentionEngine`).
    """

    def __init__(
        self,
        layer: DeepseekV4Attention,
        kv_cache_dtype: str = "auto",
        num_blocks: int | None = 256,
        device: torch.device | str | None = None,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 65536,
        max_num_reqs: int = 256,
        impl: str = "auto",
        deterministic: bool = False,
    ) -> None:
        if not isinstance(layer, DeepseekV4Attention):
            raise TypeError(f"layer must be a DeepseekV4Attention, got {type(layer).__name__}")
        self.engine = PagedAttentionEngine(
            [layer], kv_cache_dtype, num_blocks=num_blocks, device=device,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            max_num_reqs=max_num_reqs, impl=impl, deterministic=deterministic)
        self.layer = layer

    # ---- views of the engine -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    @property
    def manager(self):
        return self.engine.manager

    @property
    def caches(self):
        return self.engine.caches[0]

    @property
    def builder(self):
        return self.engine.builder

    @property
    def specs(self):
        from dsv4attn.kv_cache.specs import layer_cache_specs

        return {s.name: s for s in layer_cache_specs(self.engine.cache_config, 0)}

    @property
    def requests(self) -> list[Hashable]:
        """Ids of the live requests."""
        return self.engine.requests

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` already processed (raises ``KeyError`` if unknown)."""
        return self.engine.seq_len(request_id)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the context-sized group (what ``num_blocks`` sized; SWA for a sliding layer)."""
        return self.engine.num_free_blocks()

    def free(self, request_id: Hashable) -> None:
        """Release a request's blocks; ``KeyError`` for an unknown id."""
        self.engine.free(request_id)

    # ---- one step ----------------------------------------------------------------------------
    def _validate(self, chunks: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, int]:
        return check_chunks(chunks, self.layer.config.hidden_size, self.dtype, self.device)

    @torch.no_grad()
    def step(self, chunks: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        """Run one step. chunks: request id -> hidden ``[n_i, hidden_size]`` (layer dtype, device).

        New ids start at position 0; known ids continue where they stopped. Returns id ->
        output ``[n_i, hidden_size]``. An empty dict returns an empty dict.
        """
        counts = self._validate(chunks)
        if not chunks:
            self.engine.check_step({})
            return {}
        plan = self.engine.begin_step(counts)
        try:
            out = self.engine.run_layer(0, torch.cat([chunks[rid] for rid in plan.order]))
        except BaseException:
            self.engine.abort_step()
            raise
        self.engine.end_step()
        rows = plan.offsets()
        return {rid: out[rows[rid][0]:rows[rid][0] + rows[rid][1]] for rid in chunks}
