"""The DeepSeek-V4 attention layer: parameters in checkpoint layout plus its math pieces.

``DeepseekV4Attention(config, layer_idx)`` has exactly the reference module's parameters
(``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``, ``kv_norm``, ``o_a_proj``, ``o_b_proj``,
``sinks``, and for compressed layers ``compressor.*`` incl. ``compressor.indexer.*``), so a HF
state dict loads with ``strict=True``. Per token at position ``p``:

- ``qr = q_a_norm(q_a_proj(h))``; ``q = RoPE_p(RMSNorm_noweight(q_b_proj(qr)))`` per head;
- ``kv = RoPE_p(kv_norm(kv_proj(h)))`` (one shared K = V head);
- attention over the SWA set (positions ``max(0, p-W+1) .. p``) plus the compressed set
  (CSA: the indexer's top-k of entries ``< (p+1)//r``; HCA: all entries ``< (p+1)//r``),
  ``softmax(q.k * head_dim^-0.5)`` with the per-head sink in the denominator;
- inverse RoPE_p on the output's rope dims, grouped ``o_a_proj`` then ``o_b_proj``.

:meth:`forward` runs one whole sequence from position 0 without caches (plain PyTorch; the
executable spec). The paged, batched, incremental path is ``dsv4attn.serving``.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4attn.config import AttentionConfig
from dsv4attn.layers.compressor import Compressor
from dsv4attn.layers.indexer import Indexer, select_topk, topk_boundary_ties
from dsv4attn.layers.norm import RMSNorm
from dsv4attn.layers.rope import RotaryTable
from dsv4attn.ops.norm_rope import norm_rope


class GroupedLinear(nn.Linear):
    """Block-diagonal linear: ``weight [G * out_g, in_g]``; group g maps ``x[..., g, :]`` with rows
    ``g*out_g .. (g+1)*out_g - 1``. x ``[T, G, in_g]`` -> ``[T, G * out_g]``."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        G = self.groups
        w = self.weight.view(G, -1, x.shape[-1])  # [G, out_g, in_g]
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return torch.einsum("tgi,goi->tgo", x, w).flatten(1)
        # the same batched product, written straight into [T, G, out_g] (cuBLAS takes the output's
        # row stride): without autograd this saves the copy that einsum's [G, T, out_g] result needs
        out = torch.empty(x.shape[0], G, w.shape[1], dtype=torch.result_type(x, w), device=x.device)
        torch.bmm(x.transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
        return out.flatten(1)


class CSACompressor(Compressor):
    """The CSA main compressor (overlapping windows) owning the lightning ``indexer``."""

    def __init__(self, config: AttentionConfig, ratio: int) -> None:
        super().__init__(config.hidden_size, config.head_dim, ratio, overlap=True, eps=config.rms_norm_eps)
        self.indexer = Indexer(
            config.hidden_size, config.q_lora_rank, config.index_num_heads, config.index_head_dim,
            ratio, config.index_topk, config.rms_norm_eps,
        )


class DeepseekV4Attention(nn.Module):
    """One attention layer (kind from ``config.layer_kind(layer_idx)``)."""

    def __init__(self, config: AttentionConfig, layer_idx: int) -> None:
        super().__init__()
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        self.config = config
        self.layer_idx = layer_idx
        self.kind = config.layer_kind(layer_idx)
        self.ratio = config.compress_ratio(layer_idx)
        H, D, c = config.num_heads, config.head_dim, config
        self.num_heads, self.head_dim = H, D
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, c.rms_norm_eps)
        self.o_a_proj = GroupedLinear(H * D // c.o_groups, c.o_groups * c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.rotary = RotaryTable(config.rope(layer_idx), c.rope_dim)
        if self.kind == "csa":
            self.compressor: Compressor | None = CSACompressor(config, self.ratio)
        elif self.kind == "hca":
            self.compressor = Compressor(c.hidden_size, D, self.ratio, overlap=False, eps=c.rms_norm_eps)
        else:
            self.compressor = None

    def sinks_fp32(self) -> torch.Tensor:
        """The sinks as the contiguous fp32 vector the attention op takes. Cached: a bf16 model
        would otherwise convert them in every step of every layer. Refreshed in place when the
        parameter changes (its version counter); CUDA graphs captured before such a change read
        the tensor as it was until the next eager call refreshes it."""
        s = self.sinks.detach()
        if s.dtype == torch.float32 and s.is_contiguous():
            return s
        key = (s.data_ptr(), s._version, s.dtype, s.device)
        cached = self.__dict__.get("_sinks_fp32")
        if cached is None or cached[0] != key:
            value = s.float().contiguous()
            if cached is not None and cached[1].device == s.device and cached[1].shape == s.shape:
                value = cached[1].copy_(value)
            self.__dict__["_sinks_fp32"] = cached = (key, value)
        return cached[1]

    @property
    def indexer(self) -> Indexer | None:
        comp = self.compressor
        return comp.indexer if isinstance(comp, CSACompressor) else None

    def _csa_indexer(self) -> Indexer:
        idx = self.indexer
        if idx is None:
            raise ValueError(f"layer {self.layer_idx} is a {self.kind!r} layer: only CSA layers have an indexer")
        return idx

    # ---- one GEMM for every projection of the input hidden state ----------------------------
    def input_linears(self) -> list[nn.Linear]:
        """The projections that read the layer's input hidden state, in the order of
        :meth:`project_inputs`: ``q_a_proj``, ``kv_proj``, then the compressor's ``kv_proj``,
        ``gate_proj`` and (CSA) the indexer's ``kv_proj``, ``gate_proj``, ``weights_proj``."""
        lins: list[nn.Linear] = [self.q_a_proj, self.kv_proj]
        comp = self.compressor
        if comp is not None:
            lins += [comp.kv_proj, comp.gate_proj]
        idx = self.indexer
        if idx is not None:
            lins += [idx.kv_proj, idx.gate_proj, idx.scorer.weights_proj]
        return lins

    @torch.no_grad()
    def fuse_input_projections(self) -> None:
        """Make the weights of :meth:`input_linears` row blocks of one ``[sum N, hidden]`` tensor,
        so :meth:`project_inputs` runs one GEMM instead of 2-7 (the serving engine calls this on
        GPU). Parameter objects, names, values and the state dict stay as they are; a later
        ``.to()`` or a copy of the module undoes the sharing, and the projections then run
        one by one again. Idempotent: a layer whose weights are still fused is left as it is
        (CUDA graphs captured by another engine over the same layers keep reading that tensor)."""
        lins = self.input_linears()
        if self._fused_weight(lins) is not None:
            return
        fused = torch.cat([lin.weight.detach() for lin in lins])
        at = 0
        for lin in lins:
            n = lin.weight.shape[0]
            lin.weight.data = fused[at:at + n]
            at += n
        self._fused_input = fused

    def _fused_weight(self, lins: list[nn.Linear]) -> torch.Tensor | None:
        """The fused weight when every projection still is its row block, else None."""
        fused = self.__dict__.get("_fused_input")
        if fused is None:
            return None
        at = fused.data_ptr()
        row = fused.stride(0) * fused.element_size()
        for lin in lins:
            w = lin.weight
            if w.data_ptr() != at or w.dtype != fused.dtype or w.device != fused.device:
                return None
            at += w.shape[0] * row
        return fused

    def project_inputs(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        """hidden ``[T, hidden]`` -> the outputs of :meth:`input_linears` (column views of one
        GEMM's output when :meth:`fuse_input_projections` ran, else one linear each)."""
        lins = self.input_linears()
        fused = self._fused_weight(lins)
        if fused is None:
            return [lin(hidden) for lin in lins]
        return list(torch.nn.functional.linear(hidden, fused).split([lin.weight.shape[0] for lin in lins], dim=1))

    # ---- pieces shared by the dense path and the paged runner ------------------------------
    def project_q(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "reference",
        qa: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden ``[T, hidden]`` -> (q ``[T, H, D]``, qr ``[T, q_lora_rank]``), in the hidden dtype.

        ``impl`` picks the fused norm + RoPE kernel (``ops.norm_rope``) or its reference; ``qa``:
        ``q_a_proj(hidden)`` when the caller has it (:meth:`project_inputs`)."""
        eps = self.config.rms_norm_eps
        qa = self.q_a_proj(hidden) if qa is None else qa
        qr = norm_rope(qa, eps=eps, weight=self.q_a_norm.weight, impl=impl)
        q = self.q_b_proj(qr).view(hidden.shape[0], self.num_heads, self.head_dim)
        return norm_rope(q, cos, sin, eps=eps, impl=impl), qr

    def project_kv(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "reference",
        kv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden ``[T, hidden]`` -> the shared K = V row ``[T, D]`` (normed, rotated at p); ``kv``:
        ``kv_proj(hidden)`` when the caller has it."""
        kv = self.kv_proj(hidden) if kv is None else kv
        return norm_rope(kv, cos, sin, eps=self.kv_norm.eps, weight=self.kv_norm.weight, impl=impl)

    def attend_dense(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """q ``[T, H, D]``, keys ``[T, C, D]`` (candidates per token), valid bool ``[T, C]`` -> ``[T, H, D]``.

        ``out = sum_j p_j k_j`` with ``p = softmax([logits, sink])[:-1]``, logits ``q.k * D^-0.5``;
        fp32 math, result in ``q.dtype``. Tokens with no valid candidate get 0.
        """
        logits = torch.einsum("thd,tcd->thc", q.float(), keys.float()) * self.config.softmax_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        sink = self.sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("thc,tcd->thd", probs, keys.float()).to(q.dtype)

    def project_out(
        self, attn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "reference"
    ) -> torch.Tensor:
        """attn ``[T, H, D]`` -> ``[T, hidden]``: inverse RoPE at p (in place on ``attn``, which
        the caller hands over), grouped ``o_a_proj``, ``o_b_proj``."""
        attn = norm_rope(attn, cos, sin, inverse=True, out=attn, impl=impl)
        grouped = attn.reshape(attn.shape[0], self.config.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped))

    # ---- the cache-free whole-sequence path (executable spec) ------------------------------
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[T, hidden_size]`` of ONE sequence at positions ``0 .. T-1`` -> ``[T, hidden_size]``."""
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden must be [T, {self.config.hidden_size}], got {tuple(hidden.shape)}")
        T, dev, W = hidden.shape[0], hidden.device, self.config.window_size
        pos = torch.arange(T, device=dev)
        cos, sin = self.rotary(pos)
        q, qr = self.project_q(hidden, cos, sin)
        kv = self.project_kv(hidden, cos, sin)
        swa_pos = pos[:, None] - W + 1 + torch.arange(W, device=dev)[None, :]  # [T, W]
        keys = [kv[swa_pos.clamp(min=0)]]
        valid = [swa_pos >= 0]
        if self.compressor is not None:
            comp = self.compressor.compress_dense(self.compressor.state_rows(hidden, pos), self.rotary, hidden.dtype)
            n = comp.shape[0]
            eligible = (pos + 1) // self.ratio  # [T]
            if self.kind == "csa":
                scores = self._indexer_scores_dense(hidden, qr, cos, sin)
                sel = select_topk(scores, eligible, self._csa_indexer().topk).long()  # [T, K]
            else:
                sel = torch.arange(n, device=dev)[None, :].expand(T, -1)
                sel = torch.where(sel < eligible[:, None], sel, torch.full_like(sel, -1))
            keys.append(comp[sel.clamp(min=0)] if n else comp.new_zeros((T, 0, self.head_dim)))
            valid.append(sel >= 0)
        attn = self.attend_dense(q, torch.cat(keys, dim=1), torch.cat(valid, dim=1))
        return self.project_out(attn, cos, sin)

    def _indexer_scores_dense(
        self, hidden: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Indexer scores of one whole sequence: fp32 ``[T, T // r]`` (no causal mask applied)."""
        idx = self._csa_indexer()
        pos = torch.arange(hidden.shape[0], device=hidden.device)
        keys = idx.compress_dense(idx.state_rows(hidden, pos), self.rotary, hidden.dtype)
        q, w = idx.queries(qr, hidden, cos, sin)
        return idx.scores(q, w, keys[None].expand(hidden.shape[0], -1, -1))

    @torch.no_grad()
    def topk_ambiguous(self, hidden: torch.Tensor) -> torch.Tensor:
        """bool ``[T]`` for one sequence ``hidden [T, hidden_size]`` at positions 0..T-1: tokens whose
        indexer top-k has a tie at the selection boundary (CSA only; all False otherwise). For
        those tokens any tie-break is correct, so comparisons with the reference skip them."""
        T = hidden.shape[0]
        if self.kind != "csa":
            return torch.zeros(T, dtype=torch.bool, device=hidden.device)
        pos = torch.arange(T, device=hidden.device)
        cos, sin = self.rotary(pos)
        _, qr = self.project_q(hidden, cos, sin)
        scores = self._indexer_scores_dense(hidden, qr, cos, sin)
        return topk_boundary_ties(scores, (pos + 1) // self.ratio, self._csa_indexer().topk)
