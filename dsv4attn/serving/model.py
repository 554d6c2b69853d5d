"""PagedDeepseekV4: a transformers ``DeepseekV4ForCausalLM`` served over the paged backend.

Only attention goes through dsv4attn. Every other part of the model (embeddings, the
hyper-connection streams, norms, MoE with hash and learned routing, the final head) runs as
transformers' own modules: a step calls each ``DeepseekV4DecoderLayer`` as transformers does,
with its ``self_attn`` swapped (for the duration of the call only) for an adapter that runs
that layer's attention through :class:`dsv4attn.serving.engine.PagedAttentionEngine` on the
step's flat batch (all requests' new tokens back to back as one ``[1, T, hidden]`` sequence;
everything but attention is per token). The wrapped model is left usable as it was (e.g. as
the oracle); the dsv4attn layers share its attention parameters (no copy).

Per-step API (what an engine drives): ``begin_step({request: token ids})`` ->
``forward_step()`` (all layers, logits of each request's last token) -> ``end_step()``;
``free(request)``; speculative decoding adds ``rollback(request, n)`` / ``commit(request)``.
``generate(prompts, max_new_tokens)`` is greedy decoding with continuous batching on top of it
(:mod:`dsv4attn.serving.scheduler`; with ``num_speculative_tokens=k``: draft-and-verify,
:mod:`dsv4attn.serving.spec`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from dsv4attn.config import AttentionConfig
from dsv4attn.layers.attention import DeepseekV4Attention
from dsv4attn.layers.rope import RotaryTable
from dsv4attn.kv_cache.allocator import PrefixHold
from dsv4attn.serving.engine import PAGED_RATIOS, PagedAttentionEngine, StepPlan
from dsv4attn.serving.prefix_cache import PrefixCache


class _PagedSelfAttention(nn.Module):
    """Stands in for one decoder layer's ``self_attn``: ``(hidden [1, T, H], **kw) -> (out, None)``."""

    def __init__(self, engine: PagedAttentionEngine, index: int) -> None:
        super().__init__()
        self._engine, self._index = engine, index

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return self._engine.run_layer(self._index, hidden_states[0])[None], None


def _hf_parts(hf_model: nn.Module):
    model = getattr(hf_model, "model", None)
    layers = getattr(model, "layers", None)
    if model is None or layers is None or not hasattr(hf_model, "lm_head") or not hasattr(model, "hc_head"):
        raise TypeError(f"hf_model must be a transformers DeepseekV4ForCausalLM, got {type(hf_model).__name__}")
    return model, layers


class PagedDeepseekV4:
    """Serves ``hf_model`` (a transformers ``DeepseekV4ForCausalLM``) with paged attention.

    Args:
        hf_model: the model, weights as loaded (float32 or bfloat16). Moved to ``device`` if given.
        kv_cache_dtype: "auto" (cache rows in the model dtype) or "fp8_ds_mla".
        num_blocks / memory_bytes: cache size (see :class:`PagedAttentionEngine`); neither:
            room for ``max_num_reqs`` requests of ``max_model_len`` tokens.
        max_model_len: longest request (prompt + generated tokens).
        device: default: the model's device. impl: kernel path ("auto" | "triton" | "reference").
        max_num_batched_tokens: token budget of a step; max_num_reqs: live requests at once.
        num_speculative_tokens: most draft tokens a step verifies per request (0..7); sizes the
            rollback headroom of the caches (see :class:`PagedAttentionEngine`).
        deterministic: batch-invariant attention (no split-KV chosen from the batch size; see
            ``sparse_mla_attention``); default False: split-KV from a wave model of the batch.
        max_cached_prefixes: prefix caching: ``generate`` keeps up to this many token prefixes
            (multiples of ``engine.prefix_granule`` tokens) in the caches, by reference, and a
            prompt that starts with one computes only the rest (:attr:`prefix_cache`, kept across
            ``generate`` calls; 0: off). Costs only window-bounded blocks (sized for it) and
            context blocks no running request needs (given back least recently used first).
    """

    def __init__(
        self,
        hf_model: nn.Module,
        kv_cache_dtype: str = "auto",
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        max_model_len: int = 65536,
        device: torch.device | str | None = None,
        impl: str = "auto",
        max_num_batched_tokens: int = 2048,
        max_num_reqs: int = 16,
        num_speculative_tokens: int = 0,
        deterministic: bool = False,
        max_cached_prefixes: int = 0,
    ) -> None:
        model, hf_layers = _hf_parts(hf_model)
        config: Any = hf_model.config  # a transformers DeepseekV4Config
        ratios = [max(1, int(r)) for r in AttentionConfig.from_hf(config).compress_ratios]
        bad = sorted({r for r in ratios if r not in PAGED_RATIOS})
        if bad:
            raise ValueError(f"the paged backend serves compress ratios {PAGED_RATIOS} (0 = sliding); this model "
                             f"has {bad}")
        if device is not None:
            hf_model.to(device)
        param = next(hf_model.parameters())
        dev, dtype = param.device, param.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"model dtype must be float32 or bfloat16, got {dtype}")
        self.hf_model, self.config = hf_model, config
        self.attn_config = cfg = AttentionConfig.from_hf(config)
        layers = []
        for i, hl in enumerate(hf_layers):
            with torch.device("meta"):
                layer = DeepseekV4Attention(cfg, i)
            layer.load_state_dict(hl.self_attn.state_dict(), strict=True, assign=True)  # shares HF's tensors
            layer.rotary = RotaryTable(cfg.rope(i), cfg.rope_dim).to(dev)
            layers.append(layer.eval())
        self.layers = layers
        self.engine = self._make_engine(
            layers, kv_cache_dtype, num_blocks=num_blocks, memory_bytes=memory_bytes, device=dev,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            max_num_reqs=max_num_reqs, impl=impl, num_speculative_tokens=num_speculative_tokens,
            deterministic=deterministic, max_cached_prefixes=max_cached_prefixes)
        self.device, self.dtype = self.engine.device, dtype
        self.max_model_len = max_model_len
        self._adapters = [_PagedSelfAttention(self.engine, i) for i in range(len(layers))]
        self._ids: torch.Tensor | None = None
        self.prefix_cache = PrefixCache(self.engine) if max_cached_prefixes else None

    def _make_engine(self, layers: list[DeepseekV4Attention], *args, **kwargs) -> PagedAttentionEngine:
        """The attention engine over ``layers`` (``dsv4attn.distributed.model`` overrides it)."""
        return PagedAttentionEngine(layers, *args, **kwargs)

    # ---- per-step API ----------------------------------------------------------------------
    def begin_step(self, tokens: Mapping[Hashable, Sequence[int]]) -> StepPlan:
        """Open a step: ``{request: new token ids}`` (new requests start at position 0)."""
        if not isinstance(tokens, Mapping):
            raise TypeError(f"tokens must be a dict request -> token ids, got {type(tokens).__name__}")
        vocab = self.config.vocab_size
        for rid, ids in tokens.items():
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
                raise TypeError(f"tokens[{rid!r}] must be a list of ints, got {type(ids).__name__}")
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"tokens[{rid!r}] holds {t!r}: token ids are ints in [0, {vocab})")
        plan = self.engine.begin_step({rid: len(ids) for rid, ids in tokens.items()})
        flat = [t for rid in plan.order for t in tokens[rid]]
        self._ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        return plan

    @torch.no_grad()
    def forward_step(self, all_tokens: bool = False, rows: Sequence[int] | None = None) -> torch.Tensor:
        """Run every layer on the open step; returns fp32 logits ``[R, vocab]`` of each request's
        last new token, rows in ``plan.order`` (``all_tokens``: ``[T, vocab]`` of every token;
        ``rows``: ``[len(rows), vocab]`` of those flat token rows, e.g. every drafted token of the
        decodes and the last token of each prompt chunk)."""
        if self._ids is None:
            raise RuntimeError("forward_step() outside a step: call begin_step() first")
        plan = self.engine._plan
        assert plan is not None  # begin_step() opened it (self._ids is set)
        if rows is not None:
            if all_tokens:
                raise ValueError("give all_tokens or rows, not both")
            T = plan.num_tokens
            if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not all(
                    isinstance(r, int) and not isinstance(r, bool) and 0 <= r < T for r in rows):
                raise ValueError(f"rows must be a list of token rows in [0, {T}), got {rows!r}")
        model, hf_layers = _hf_parts(self.hf_model)
        ids = self._ids[None]
        try:
            with self._paged_attention(hf_layers):
                x = model.embed_tokens(ids)
                h = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
                for layer in hf_layers:
                    h = layer(h, input_ids=ids)
            if rows is not None:
                h = h[:, torch.tensor(list(rows), dtype=torch.long, device=self.device)]
            elif not all_tokens:
                h = h[:, torch.tensor([o + n - 1 for o, n in plan.offsets().values()], device=self.device)]
            h = model.norm(model.hc_head(h))
            return cast(nn.Module, self.hf_model.lm_head)(h)[0].float()
        except BaseException:
            self.abort_step()
            raise

    def end_step(self) -> StepPlan:
        """Close the step (its tokens are in the caches)."""
        self._ids = None
        return self.engine.end_step()

    def abort_step(self) -> None:
        """Drop the open step (blocks back, new requests forgotten)."""
        self._ids = None
        if self.engine.in_step:
            self.engine.abort_step()

    def step(self, tokens: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, torch.Tensor]:
        """begin_step + forward_step + end_step: request -> fp32 logits ``[vocab]`` of its last token."""
        plan = self.begin_step(tokens)
        logits = self.forward_step()
        self.end_step()
        return {rid: logits[i] for i, rid in enumerate(plan.order)}

    def free(self, request: Hashable) -> None:
        """Forget a request and release its cache blocks."""
        self.engine.free(request)

    def save_prefix(self, request: Hashable, num_tokens: int) -> PrefixHold:
        """Hold ``request``'s first ``num_tokens`` tokens in the caches for other requests to start
        from (see :meth:`PagedAttentionEngine.save_prefix`)."""
        return self.engine.save_prefix(request, num_tokens)

    def add_request(self, request: Hashable, prefix: PrefixHold) -> None:
        """Start ``request`` from a prefix hold; its next ``begin_step`` feeds the tokens after
        the prefix (see :meth:`PagedAttentionEngine.add_request`)."""
        self.engine.add_request(request, prefix)

    @property
    def requests(self) -> list[Hashable]:
        return self.engine.requests

    def rollback(self, request: Hashable, num_tokens: int) -> int:
        """Take the last ``num_tokens`` tokens of ``request`` back (rejected drafts); see
        :meth:`PagedAttentionEngine.rollback`."""
        return self.engine.rollback(request, num_tokens)

    def commit(self, request: Hashable) -> int:
        """Accept every token of ``request`` in the caches (see :meth:`PagedAttentionEngine.commit`)."""
        return self.engine.commit(request)

    def warmup(self, max_prefill_tokens: int = 64) -> int:
        """Compile every attention kernel specialisation serving meets before serving (see
        :meth:`PagedAttentionEngine.warmup`); call it with no request live. Returns the steps run."""
        return self.engine.warmup(max_prefill_tokens)

    def enable_cuda_graphs(self, buckets: Sequence[int] | None = None, capture: bool = True) -> None:
        """Run decode-only steps' attention through CUDA graphs per batch-size bucket (padded);
        see :meth:`PagedAttentionEngine.enable_cuda_graphs`."""
        self.engine.enable_cuda_graphs(buckets, capture)

    @contextlib.contextmanager
    def _paged_attention(self, hf_layers):
        saved = [hl.self_attn for hl in hf_layers]
        try:
            for hl, a in zip(hf_layers, self._adapters):
                hl._modules["self_attn"] = a
            yield
        finally:
            for hl, s in zip(hf_layers, saved):
                hl._modules["self_attn"] = s

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, token_budget: int | None = None,
                 chunk_size: int | None = None, eos_token_id: int | None = None,
                 progress: Callable[[int], None] | None = None, num_speculative_tokens: int = 0,
                 drafter=None, return_stats: bool = False):
        """Greedy decoding of every prompt with continuous batching; returns the new tokens of
        each prompt (``max_new_tokens`` of them unless ``eos_token_id`` came first).

        Each step holds one decode token for every running request and fills the rest of
        ``token_budget`` (default: max_num_batched_tokens) with prompt chunks of at most
        ``chunk_size`` tokens; requests join when blocks and slots allow and leave when done.
        ``progress(n)`` is called with the tokens each step processed.

        ``num_speculative_tokens=k`` (<= the model's): every decode step verifies up to k draft
        tokens per request from ``drafter`` (default: prompt lookup,
        :class:`dsv4attn.serving.drafter.NgramDrafter`) and rolls rejected ones back; greedy
        output is the same as with k = 0. ``return_stats``: return ``(outputs, SpecStats)``
        (acceptance rate, tokens/s; also logged).

        With ``max_cached_prefixes > 0`` prompts start from the longest prefix an earlier request
        left (in this call or an earlier one) and compute only the rest; :attr:`prefix_cache`
        ``.stats`` counts the hits. Outputs are the same either way.
        """
        if num_speculative_tokens or drafter is not None or return_stats:
            from dsv4attn.serving.spec import SpeculativeBatcher

            batcher = SpeculativeBatcher(self, num_speculative_tokens, drafter=drafter, token_budget=token_budget,
                                         chunk_size=chunk_size)
            outs = batcher.run(prompts, max_new_tokens, eos_token_id=eos_token_id, progress=progress)
            return (outs, batcher.stats) if return_stats else outs
        from dsv4attn.serving.scheduler import ContinuousBatcher

        return ContinuousBatcher(self, token_budget=token_budget, chunk_size=chunk_size).run(
            prompts, max_new_tokens, eos_token_id=eos_token_id, progress=progress)


@torch.no_grad()
def reference_generate(hf_model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """The oracle: transformers' own ``generate(do_sample=False)`` one prompt at a time, with
    eager attention (the only transformers path with the sinks) and no early stop."""
    hf: Any = hf_model  # a transformers model: config, generation_config and generate are dynamic
    impl = getattr(hf.config, "_attn_implementation", None)
    if impl != "eager":
        if hasattr(hf_model, "set_attn_implementation"):
            hf.set_attn_implementation("eager")
        else:
            hf.config._attn_implementation = "eager"
    dev = next(hf_model.parameters()).device
    gc = copy.deepcopy(hf.generation_config)
    gc.do_sample, gc.max_new_tokens, gc.eos_token_id, gc.pad_token_id = False, max_new_tokens, None, 0
    out = []
    for p in prompts:
        ids = torch.tensor([list(p)], dtype=torch.long, device=dev)
        gen = hf.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids))
        out.append(gen[0, ids.shape[1]:].tolist())
        if progress is not None:
            progress(ids.shape[1] + max_new_tokens)
    return out
