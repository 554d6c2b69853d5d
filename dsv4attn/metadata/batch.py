"""The batch description of one step: what every builder reads (vLLM's CommonAttentionMetadata).

A step holds ``R`` requests whose query tokens are laid out back to back, decodes first.
Request ``q`` contributes ``query_len[q] = query_start_loc[q+1] - query_start_loc[q]`` tokens
(0 allowed) and has ``seq_len[q]`` tokens in total after this step; token ``t`` of request ``q``
sits at position ``p = seq_len[q] - query_len[q] + (t - query_start_loc[q])``.

Padding follows the engine convention: a padded token (e.g. a CUDA-graph pad request) is an
ordinary token whose raw ``slot_mapping`` is -1; builders give it zero-length candidate sets.

Per-group block tables are keyed by the cache-group names of :mod:`dsv4attn.kv_cache.specs`:
``"swa"`` (SWA KV) and ``"full_mla"`` (the compressed KV of C4A and C128A layers and the C4A
indexer keys share it, as in vLLM); the state groups ``"c4_state"`` / ``"c128_state"`` may be
given too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from dsv4attn._checks import INT32_MAX, as_device, check_int, check_tensor
from dsv4attn.kv_cache.specs import GROUP_FULL_MLA, GROUP_SWA, GROUPS

#: Deprecated aliases (the compressed block tables of both ratios are the full-MLA group's).
GROUP_C4 = GROUP_C128 = GROUP_FULL_MLA


def _host_ints(name: str, v: object, dtype: torch.dtype = torch.int32) -> list[int]:
    """A 1-D sequence of ints (list/tuple or tensor of ``dtype``) as a Python list."""
    if isinstance(v, torch.Tensor):
        check_tensor(name, v, dtype=dtype, ndim=1)
        return v.detach().cpu().tolist()
    if not isinstance(v, Sequence) or isinstance(v, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of ints or a 1-D {dtype} tensor, got {type(v).__name__}")
    out = list(v)
    for i, x in enumerate(out):
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{name}[{i}] must be an int, got {type(x).__name__}")
    return out


def split_decodes_and_prefills(
    query_lens: Sequence[int], decode_threshold: int, require_uniform: bool = False
) -> tuple[int, int, int, int]:
    """``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` of a decodes-first batch.

    Decodes are the leading requests with ``query_len <= decode_threshold`` (speculative tokens
    count as decodes: threshold = 1 + num_speculative_tokens). ``require_uniform`` additionally
    ends the decode prefix at the first request whose query_len differs from the first one's
    (the indexer's rule). Raises ``ValueError`` when a request of ``query_len <= threshold``
    follows one above it (the batch is not ordered decodes-first).
    """
    ql = list(query_lens)
    nd = 0
    while nd < len(ql) and ql[nd] <= decode_threshold:
        nd += 1
    for i in range(nd, len(ql)):
        if ql[i] <= decode_threshold:
            raise ValueError(
                f"batch is not ordered decodes-first: request {i} has query_len {ql[i]} <= "
                f"decode_threshold {decode_threshold} after request {nd} with query_len {ql[nd]}"
            )
    if require_uniform and nd > 0:
        nd_uniform = 0
        while nd_uniform < nd and ql[nd_uniform] == ql[0]:
            nd_uniform += 1
        nd = nd_uniform
    nd_tokens = sum(ql[:nd])
    return nd, len(ql) - nd, nd_tokens, sum(ql) - nd_tokens


@dataclass(frozen=True)
class BatchMetadata:
    """One step's batch, validated. Device tensors plus host copies of the per-request ints.

    Fields (R = num_reqs, T = num_tokens):
        query_start_loc: int32 [R+1] on ``device``; 0, non-decreasing.
        seq_lens: int32 [R]; total length incl. this step's tokens, >= query_len.
        positions: int64 [T]; the position identity above.
        slot_mapping: int64 [T]; raw SWA-group slot per token, -1 = padded token.
        token_to_req: int32 [T]; request of each token.
        block_tables: group name -> int32 [>=R, max_blocks] (read-only mapping).
        query_lens_cpu, seq_lens_cpu: per-request ints on the host.
        positions_cpu: int64 [T] on the CPU (host-side accounting and checks, no sync).
        decode_threshold: 1 + num_speculative_tokens.
        num_decodes / num_prefills / num_decode_tokens / num_prefill_tokens: the split.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_to_req: torch.Tensor
    block_tables: Mapping[str, torch.Tensor]
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    positions_cpu: torch.Tensor
    num_speculative_tokens: int
    require_uniform: bool
    decode_threshold: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """Tokens of this step (= num_actual_tokens; padded tokens included, slot -1)."""
        return int(self.positions_cpu.shape[0])

    num_actual_tokens = num_tokens

    @functools.cached_property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @functools.cached_property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @functools.cached_property
    def max_active_seq_len(self) -> int:
        """Longest seq_len among requests with at least one token this step (0 if none)."""
        return max((s for s, q in zip(self.seq_lens_cpu, self.query_lens_cpu) if q > 0), default=0)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @classmethod
    def from_requests(
        cls,
        query_lens: Sequence[int] | torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor,
        block_tables: Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        num_speculative_tokens: int = 0,
        require_uniform: bool = False,
        swa_block_size: int = 64,
        device: torch.device | str | None = None,
    ) -> "BatchMetadata":
        """Build and validate from per-request ints (host) and per-group block tables.

        ``slot_mapping`` (int64 [T]) defaults to the slot of each token's own position in the
        SWA cache (``block_tables["swa"]``, ``swa_block_size`` entries per block), i.e. no padded
        tokens. ``positions`` (int64 [T]), when given, must equal the derived positions.
        ``device`` defaults to the device of ``block_tables["swa"]``.
        """
        ql = _host_ints("query_lens", query_lens)
        qsl = [0]
        for i, q in enumerate(ql):
            if q < 0:
                raise ValueError(f"query_lens[{i}] must be >= 0, got {q}")
            qsl.append(qsl[-1] + q)
        return cls._build(qsl, seq_lens, block_tables, slot_mapping, positions, num_speculative_tokens,
                          require_uniform, swa_block_size, device)

    @classmethod
    def from_tensors(
        cls,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: Mapping[str, torch.Tensor],
        slot_mapping: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        num_speculative_tokens: int = 0,
        require_uniform: bool = False,
        swa_block_size: int = 64,
        device: torch.device | str | None = None,
    ) -> "BatchMetadata":
        """Like ``from_requests`` but from engine tensors (``query_start_loc`` int32 [R+1],
        ``seq_lens`` int32 [R]); copies them to the host to validate (one sync)."""
        qsl = _host_ints("query_start_loc", query_start_loc)
        return cls._build(qsl, seq_lens, block_tables, slot_mapping, positions, num_speculative_tokens,
                          require_uniform, swa_block_size, device)

    @classmethod
    def _build(cls, qsl, seq_lens, block_tables, slot_mapping, positions, num_spec, require_uniform,
               swa_block_size, device) -> "BatchMetadata":
        sl = _host_ints("seq_lens", seq_lens)
        num_reqs = len(sl)
        if len(qsl) != num_reqs + 1:
            raise ValueError(f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries, got {len(qsl)}")
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc[0] must be 0, got {qsl[0]}")
        ql = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
        for i, q in enumerate(ql):
            if q < 0:
                raise ValueError(f"query_start_loc must be non-decreasing: [{i}]={qsl[i]} > [{i + 1}]={qsl[i + 1]}")
            if sl[i] < q:
                raise ValueError(f"seq_lens[{i}]={sl[i]} is smaller than its query_len {q}")
            if sl[i] > INT32_MAX - 1:
                raise ValueError(f"seq_lens[{i}]={sl[i]} passes the int32 limit")
        if qsl[-1] > INT32_MAX:
            raise ValueError(f"the step has {qsl[-1]} tokens, past the int32 limit")
        check_int("swa_block_size", swa_block_size, 1, INT32_MAX)
        if isinstance(num_spec, bool) or not isinstance(num_spec, int) or num_spec < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {num_spec!r}")
        if not isinstance(block_tables, Mapping):
            raise TypeError(f"block_tables must be a mapping group name -> tensor, got {type(block_tables).__name__}")
        if GROUP_SWA not in block_tables:
            raise ValueError(f"block_tables must be a mapping with at least the key {GROUP_SWA!r}")
        unknown = set(block_tables) - set(GROUPS)
        if unknown:
            raise ValueError(f"block_tables has unknown groups {sorted(unknown)}; known: {GROUPS}")
        # canonical device (cuda -> cuda:N) so comparisons with tensors' devices hold
        swa_table = check_tensor(f"block_tables[{GROUP_SWA!r}]", block_tables[GROUP_SWA])
        dev = as_device("device", device) if device is not None else swa_table.device
        for name, bt in block_tables.items():
            check_tensor(f"block_tables[{name!r}]", bt, dtype=torch.int32, ndim=2, device=dev)
            if bt.shape[0] < num_reqs:
                raise ValueError(f"block_tables[{name!r}] has {bt.shape[0]} rows, fewer than num_reqs={num_reqs}")
        num_tokens = qsl[-1]
        req_cpu = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int32), torch.tensor(ql, dtype=torch.int64))
        t = torch.arange(num_tokens, dtype=torch.int64)
        qsl_t = torch.tensor(qsl, dtype=torch.int64)
        sl_t = torch.tensor(sl, dtype=torch.int64)
        ql_t = torch.tensor(ql, dtype=torch.int64)
        pos_cpu = (sl_t - ql_t)[req_cpu.long()] + t - qsl_t[req_cpu.long()] if num_tokens else t
        if positions is not None:
            check_tensor("positions", positions, dtype=torch.int64, shape=(num_tokens,), device=dev)
            bad = (positions.cpu() != pos_cpu).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise ValueError(f"positions[{i}]={int(positions[i])} is inconsistent with seq_lens and "
                                 f"query_start_loc (expected {int(pos_cpu[i])})")
        if slot_mapping is None:
            bt = block_tables[GROUP_SWA]
            need = -(-max(sl, default=0) // swa_block_size)
            if need > bt.shape[1]:
                raise ValueError(f"block_tables['swa'] has {bt.shape[1]} columns, needs {need} to derive slot_mapping")
            bt_cpu = bt.cpu().long()
            cols = pos_cpu // swa_block_size
            slot_cpu = bt_cpu[req_cpu.long(), cols] * swa_block_size + pos_cpu % swa_block_size
            slot_mapping = slot_cpu.to(dev)
        else:
            check_tensor("slot_mapping", slot_mapping, dtype=torch.int64, shape=(num_tokens,), device=dev)
            slot_mapping = slot_mapping.contiguous()
        nd, npf, ndt, npt = split_decodes_and_prefills(ql, 1 + num_spec, require_uniform)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(sl, dtype=torch.int32, device=dev),
            positions=pos_cpu.to(dev),
            slot_mapping=slot_mapping,
            token_to_req=req_cpu.to(dev),
            block_tables=MappingProxyType(dict(block_tables)),
            query_lens_cpu=tuple(ql),
            seq_lens_cpu=tuple(sl),
            positions_cpu=pos_cpu,
            num_speculative_tokens=num_spec,
            require_uniform=require_uniform,
            decode_threshold=1 + num_spec,
            num_decodes=nd,
            num_prefills=npf,
            num_decode_tokens=ndt,
            num_prefill_tokens=npt,
        )
