"""Per-step metadata builders: one per cache group, run once per step and shared by all layers.

``StepMetadataBuilder(config, device).build(batch)`` returns a ``StepMetadata`` whose tensors
are slices of buffers allocated once in the constructor from ``MetadataConfig`` (their
``data_ptr`` never changes between builds, as CUDA-graph replay needs). Groups:

- SWA (every layer): token -> request map, validity, and either per-decode-token index rows
  (``[nd, W]`` global SWA slots + lengths; forms "full" and "real") or ranges (form "range").
- C4A compressed (r=4): compressed slot mapping; ``global_topk`` converts an indexer's
  request-local top-k rows to global slots (per layer, into one persistent buffer).
- C128A compressed (r=128): compressed slot mapping and either dense top-k rows (engine form
  "full": every row ``round_up(cdiv(max_model_len, 128), 128)`` wide, fully written; form
  "real": each row written only up to ``round_up(n, 128)``) or range lengths (form "range":
  starts are a persistent zero buffer, no rows).

The range form follows the interface contract: token t sees entries ``starts[t] ..
starts[t] + lengths[t] - 1`` of its request's stream through the group's block table.
``metadata_bytes_written`` reports the bytes a build writes in each form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast
import functools
from dataclasses import dataclass
from types import MappingProxyType

import torch

from dsv4attn.kv_cache.specs import GROUP_FULL_MLA, GROUP_SWA
from dsv4attn.metadata.batch import BatchMetadata
from dsv4attn.ops import metadata as ops
from dsv4attn._checks import INT32_MAX, check_values
from dsv4attn.kv_cache import slots
from dsv4attn.kv_cache.slots import C128A_TOPK_ALIGNMENT

FORMS = ("full", "real", "range")
#: Tokens per logical block of the compressed (full-MLA) group: the backend's kernel block size.
MLA_BLOCK_SIZE = 256


@dataclass(frozen=True)
class MetadataConfig:
    """Sizes the builders' persistent buffers; validated here.

    ``num_blocks``: blocks in each group's cache (an int = one shared pool), used to reject block
    ids out of range. ``form``: "full" (engine-compatible rows), "real" (rows up to the real
    context) or "range" (no rows). ``validate_block_ids`` checks every used block id each build
    (one host sync per group); turn off inside CUDA-graph capture.
    """

    max_num_batched_tokens: int
    max_num_reqs: int
    max_model_len: int
    num_blocks: int | Mapping[str, int]
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (4, 128)
    swa_block_size: int = 64
    mla_block_size: int = MLA_BLOCK_SIZE
    index_topk: int = 512
    form: str = "full"
    validate_block_ids: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_reqs", "max_model_len", "window_size",
                     "swa_block_size", "mla_block_size", "index_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MetadataConfig.{name} must be an int >= 1, got {v!r}")
        if self.form not in FORMS:
            raise ValueError(f"MetadataConfig.form must be one of {FORMS}, got {self.form!r}")
        ratios = tuple(self.compress_ratios)
        if any(r not in (4, 128) for r in ratios) or len(set(ratios)) != len(ratios):
            raise ValueError(f"MetadataConfig.compress_ratios must be distinct values of (4, 128), got {ratios}")
        for r in ratios:
            if self.mla_block_size % r:
                raise ValueError(f"mla_block_size {self.mla_block_size} must be a multiple of ratio {r}")
        nb = self.num_blocks
        if isinstance(nb, bool) or not isinstance(nb, (int, Mapping)):
            raise TypeError(f"MetadataConfig.num_blocks must be an int or a mapping group -> int, got {nb!r}")
        nb = {g: nb for g in (GROUP_SWA, GROUP_FULL_MLA)} if isinstance(nb, int) else dict(nb)
        needed = (GROUP_SWA, GROUP_FULL_MLA) if ratios else (GROUP_SWA,)
        missing = [g for g in needed if g not in nb]
        if missing:
            raise ValueError(f"MetadataConfig.num_blocks lacks cache group(s) {missing} (needed: {list(needed)})")
        for g, v in nb.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MetadataConfig.num_blocks[{g!r}] must be an int >= 1, got {v!r}")
        object.__setattr__(self, "compress_ratios", ratios)
        object.__setattr__(self, "num_blocks", MappingProxyType(nb))
        if self.max_model_len > INT32_MAX - 1 or self.max_num_batched_tokens > INT32_MAX:
            raise ValueError(f"MetadataConfig.max_model_len ({self.max_model_len}) and max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must stay below the int32 limit")
        for g, bs in ((GROUP_SWA, self.swa_block_size), (GROUP_FULL_MLA, self.mla_block_size // min(ratios or (1,)))):
            if g in nb and nb[g] * bs - 1 > INT32_MAX:
                raise ValueError(f"MetadataConfig.num_blocks[{g!r}] = {nb[g]} blocks of {bs} entries give slots past the "
                                 "int32 limit of the metadata outputs")

    def entries_per_block(self, ratio: int) -> int:
        """Compressed entries physically stored per block for ratio r (64 for 4, 2 for 128)."""
        return self.mla_block_size // ratio

    @property
    def c128a_max_compressed(self) -> int:
        """Row width of the C128A top-k buffers: ``round_up(cdiv(max_model_len, 128), 128)``."""
        return slots.c128a_max_compressed(self.max_model_len, 128)


@dataclass(frozen=True)
class SWAMetadata:
    """SWA group. decode_indices int32 [nd, W] / decode_lens int32 [nd] (forms full, real);
    starts / lengths int32 [T] (form range). block_size = SWA entries per block."""

    block_table: torch.Tensor
    block_size: int
    window_size: int
    decode_indices: torch.Tensor | None
    decode_lens: torch.Tensor | None
    starts: torch.Tensor | None
    lengths: torch.Tensor | None


@dataclass(frozen=True)
class CompressedMetadata:
    """A compressed group (ratio 4 or 128). slot_mapping int64 [T] (compressed slot per raw
    token, -1 if none). C4A: lengths int32 [T] = the entries each token may select,
    ``(p + 1) // 4`` (0 for padded tokens). C128A: global_decode int32 [nd, Wc], decode_lens
    int32 [nd], prefill_local int32 [T-nd, Wc] (forms full, real); starts (zeros) / lengths
    int32 [T] (range).

    In form "real" a row is valid only up to its own length (decode: ``decode_lens``; prefill:
    ``(p + 1) // 128``, -1 padded to a multiple of 128); columns past ``round_up(n, 128)`` hold
    stale values from earlier steps and must not be read (every kernel of this project bounds
    its reads by the length, as the interface contract requires)."""

    compress_ratio: int
    block_table: torch.Tensor
    block_size: int
    slot_mapping: torch.Tensor
    global_decode: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    prefill_local: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


@dataclass(frozen=True)
class StepMetadata:
    """Everything the layers of one step read; token_to_req int32 [T], is_valid_token bool [T]."""

    batch: BatchMetadata
    config: MetadataConfig
    form: str
    token_to_req: torch.Tensor
    is_valid_token: torch.Tensor
    swa: SWAMetadata
    compressed: Mapping[int, CompressedMetadata]

    @functools.cached_property
    def bytes_written(self) -> Mapping[str, int]:
        """Bytes the build wrote, per output (computed on first access: host work off the step)."""
        return MappingProxyType(metadata_bytes_written(self.batch, self.config, self.form))

    @property
    def total_bytes_written(self) -> int:
        return sum(self.bytes_written.values())


def metadata_bytes_written(batch: BatchMetadata, config: MetadataConfig, form: str | None = None) -> dict[str, int]:
    """Bytes one ``StepMetadataBuilder.build`` writes for ``batch`` in ``form`` (default: the
    config's), per output. Host-only arithmetic over ``batch.positions_cpu``; exact for both
    kernel paths (tests check it element by element against poisoned buffers).
    """
    form = config.form if form is None else form
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    t, nd, w = batch.num_tokens, batch.num_decode_tokens, config.window_size
    max_t = config.max_num_batched_tokens
    out = {"token_to_req": 4 * t, "is_valid_token": t}
    if form == "range":
        out["swa.starts"] = 4 * t
        out["swa.lengths"] = 4 * t
    else:
        out["swa.decode_indices"] = 4 * nd * w
        out["swa.decode_lens"] = 4 * (max_t if form == "full" else nd)  # engine zeroes the tail
    for r in config.compress_ratios:
        out[f"c{r}.slot_mapping"] = 8 * (max_t if form == "full" else t)
    if 4 in config.compress_ratios:
        out["c4.entry_limit"] = 4 * t
    if 128 in config.compress_ratios:
        wc = config.c128a_max_compressed
        if form == "range":
            out["c128.lengths"] = 4 * t
        else:
            if form == "full":
                cols = t * wc
            else:
                n = ((batch.positions_cpu + 1) // 128).clamp(min=0)
                ends = ((n + C128A_TOPK_ALIGNMENT - 1) // C128A_TOPK_ALIGNMENT * C128A_TOPK_ALIGNMENT).clamp(max=wc)
                cols = int(ends.sum())
            out["c128.topk_rows"] = 4 * cols
            out["c128.decode_lens"] = 4 * nd
    return out


class StepMetadataBuilder:
    """Owns every group's persistent buffers; ``build(batch)`` once per step (see module doc)."""

    def __init__(self, config: MetadataConfig, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, MetadataConfig):
            raise TypeError(f"config must be a MetadataConfig, got {type(config).__name__}")
        self.config = c = config
        # canonical device (cuda -> cuda:N) so comparisons with tensors' devices hold
        self.device = dev = torch.empty(0, device=device).device
        mt, i32 = c.max_num_batched_tokens, torch.int32
        self.token_to_req = torch.zeros(mt, dtype=i32, device=dev)
        self.is_valid_token = torch.zeros(mt, dtype=torch.bool, device=dev)
        self.swa_decode_indices = torch.full((mt, c.window_size), -1, dtype=i32, device=dev)
        self.swa_decode_lens = torch.zeros(mt, dtype=i32, device=dev)
        self.swa_starts = torch.zeros(mt, dtype=i32, device=dev)
        self.swa_lengths = torch.zeros(mt, dtype=i32, device=dev)
        self.slot_mapping = {r: torch.full((mt,), -1, dtype=torch.int64, device=dev) for r in c.compress_ratios}
        if 4 in c.compress_ratios:
            self.c4_global_topk = torch.full((mt, c.index_topk), -1, dtype=i32, device=dev)
            self.c4_topk_lens = torch.zeros(mt, dtype=i32, device=dev)
            self.c4_entry_limit = torch.zeros(mt, dtype=i32, device=dev)
        if 128 in c.compress_ratios:
            wc = c.c128a_max_compressed
            self.c128_global_decode = torch.full((mt, wc), -1, dtype=i32, device=dev)
            self.c128_decode_lens = torch.zeros(mt, dtype=i32, device=dev)
            self.c128_prefill = torch.full((mt, wc), -1, dtype=i32, device=dev)
            self.c128_lengths = torch.zeros(mt, dtype=i32, device=dev)
            self._c128_zero_starts = torch.zeros(mt, dtype=i32, device=dev)  # written once, never per step

    def buffers(self) -> dict[str, torch.Tensor]:
        """The per-step output buffers by name (not the constant zero starts)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor) and not k.startswith("_")} | {
            f"c{r}_slot_mapping": v for r, v in self.slot_mapping.items()
        }

    # -- validation ----------------------------------------------------------------------------
    def _check_batch(self, batch: BatchMetadata) -> None:
        c = self.config
        if not isinstance(batch, BatchMetadata):
            raise TypeError(f"batch must be a BatchMetadata, got {type(batch).__name__}")
        if batch.device != self.device:
            raise ValueError(f"batch is on {batch.device}, builder buffers on {self.device}")
        if batch.num_tokens > c.max_num_batched_tokens:
            raise ValueError(f"batch has {batch.num_tokens} tokens, more than max_num_batched_tokens="
                             f"{c.max_num_batched_tokens}")
        if batch.num_reqs > c.max_num_reqs:
            raise ValueError(f"batch has {batch.num_reqs} requests, more than max_num_reqs={c.max_num_reqs}")
        if batch.max_seq_len > c.max_model_len:
            raise ValueError(f"batch has seq_len {batch.max_seq_len}, more than max_model_len={c.max_model_len}")
        # Longest context among requests with tokens this step: O(1) column bounds per group.
        sl_max = batch.max_active_seq_len
        swa_cols = (sl_max - 1) // c.swa_block_size + 1 if sl_max else 0
        self._check_columns(batch, GROUP_SWA, swa_cols, sl_max)
        for r in c.compress_ratios:
            n = sl_max // r
            need = (n - 1) // c.entries_per_block(r) + 1 if n else 0
            self._check_columns(batch, GROUP_FULL_MLA, need, sl_max)
        if c.validate_block_ids and batch.num_tokens:
            # The raw SWA slots are written by the SWA cache writer without a per-layer check.
            cap = cast(Mapping[str, int], c.num_blocks)[GROUP_SWA] * c.swa_block_size
            check_values("batch.slot_mapping", batch.slot_mapping, -1, cap - 1)
        if c.validate_block_ids and batch.num_reqs:
            sl = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64)
            ql = torch.tensor(batch.query_lens_cpu, dtype=torch.int64)
            has_tokens = ql > 0
            # SWA: columns holding positions max(0, first_pos - W + 1) .. seq_len - 1.
            lo = (sl - ql - c.window_size + 1).clamp(min=0) // c.swa_block_size
            hi = torch.where(has_tokens, (sl - 1) // c.swa_block_size + 1, lo)
            self._check_ids(batch, GROUP_SWA, lo, hi)
            for r in c.compress_ratios:
                n_ent = sl // r
                hi = torch.where(has_tokens & (n_ent > 0), (n_ent - 1) // c.entries_per_block(r) + 1,
                                 torch.zeros_like(n_ent))
                self._check_ids(batch, GROUP_FULL_MLA, torch.zeros_like(hi), hi)

    @staticmethod
    def _check_columns(batch: BatchMetadata, group: str, need: int, seq_len: int) -> None:
        if group not in batch.block_tables:
            raise ValueError(f"batch.block_tables lacks group {group!r} needed by this config")
        cols = batch.block_tables[group].shape[1]
        if need > cols:
            raise ValueError(f"block_tables[{group!r}] has {cols} columns; seq_len {seq_len} needs {need}")

    def _check_ids(self, batch: BatchMetadata, group: str, lo: torch.Tensor, hi: torch.Tensor) -> None:
        """Every block id in a used column must lie in [0, num_blocks) (one host sync)."""
        bt = batch.block_tables[group]
        need = int(hi.max())
        if need == 0:
            return
        nb = cast(Mapping[str, int], self.config.num_blocks)[group]
        cols = torch.arange(need, device=bt.device)[None, :]
        used = (cols >= lo.to(bt.device)[:, None]) & (cols < hi.to(bt.device)[:, None])
        tab = bt[: batch.num_reqs, :need]
        bad = used & ((tab < 0) | (tab >= nb))
        if bool(bad.any()):
            q, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"block_tables[{group!r}][{q}, {j}] = {int(tab[q, j])} is not a block id in "
                             f"[0, num_blocks={nb})")

    # -- build ---------------------------------------------------------------------------------
    def build(self, batch: BatchMetadata, impl: str = "auto") -> StepMetadata:
        """Validate ``batch`` against the buffers and tables, then run every group's builder."""
        self._check_batch(batch)
        c, form = self.config, self.config.form
        t, nd = batch.num_tokens, batch.num_decode_tokens
        t2r, valid = self.token_to_req[:t], self.is_valid_token[:t]
        t2r.copy_(batch.token_to_req)
        torch.ge(batch.slot_mapping, 0, out=valid)
        pos, sm = batch.positions, batch.slot_mapping
        swa_bt = batch.block_tables[GROUP_SWA]
        if form == "range":
            st, ln = ops.compute_swa_ranges(pos, sm, c.window_size, self.swa_starts, self.swa_lengths, validate=False,
                                            impl=impl)
            swa = SWAMetadata(swa_bt, c.swa_block_size, c.window_size, None, None, st, ln)
        else:
            if form == "full":
                self.swa_decode_lens[nd:].zero_()
            idx, lens = ops.compute_swa_indices_and_lens(
                pos[:nd], t2r[:nd], swa_bt, c.swa_block_size, sm[:nd], c.window_size,
                self.swa_decode_indices, self.swa_decode_lens, validate=False, impl=impl,
            )
            swa = SWAMetadata(swa_bt, c.swa_block_size, c.window_size, idx, lens, None, None)
        comp: dict[int, CompressedMetadata] = {}
        for r in c.compress_ratios:
            bt = batch.block_tables[GROUP_FULL_MLA]
            bs = c.entries_per_block(r)
            buf = self.slot_mapping[r] if form == "full" else self.slot_mapping[r][:t]
            csm = ops.get_compressed_slot_mapping(t, batch.query_start_loc, batch.seq_lens, bt, bs, r, out=buf,
                                                  validate=False, impl=impl)
            extra = {}
            if r == 4:  # the entries each token may select from: top-k indices at or past it are holes
                extra = dict(lengths=ops.compute_c128a_range_lengths(pos, sm, r, self.c4_entry_limit, validate=False,
                                                                     impl=impl))
            elif r == 128 and form == "range":
                extra = dict(starts=self._c128_zero_starts[:t],
                             lengths=ops.compute_c128a_range_lengths(pos, sm, r, self.c128_lengths, validate=False,
                                                                     impl=impl))
            elif r == 128:
                g, dl, pf = ops.build_c128a_topk_metadata(
                    pos, r, nd, t2r, bt, bs, sm, self.c128_global_decode, self.c128_decode_lens, self.c128_prefill,
                    c.c128a_max_compressed, full_width=(form == "full"), validate=False, impl=impl,
                )
                extra = dict(global_decode=g, decode_lens=dl, prefill_local=pf)
            comp[r] = CompressedMetadata(r, bt, bs, csm, **extra)
        return StepMetadata(batch, c, form, t2r, valid, swa, MappingProxyType(comp))

    def global_topk(self, step: StepMetadata, topk_local: torch.Tensor, impl: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """C4A: request-local top-k int32 ``[n, K]`` (rows = the step's first n tokens, K <=
        index_topk) -> ``(global int32 [n, K], lens int32 [n])``, slices of one persistent buffer
        that the next call overwrites (one layer at a time)."""
        if 4 not in self.config.compress_ratios:
            raise ValueError("global_topk needs compress ratio 4 in MetadataConfig.compress_ratios")
        if not isinstance(step, StepMetadata) or step.config is not self.config:
            raise TypeError("step must be the StepMetadata this builder built")
        n = topk_local.shape[0] if isinstance(topk_local, torch.Tensor) else -1
        if not 0 <= n <= step.batch.num_tokens:
            raise ValueError(f"topk_local must be a tensor with at most {step.batch.num_tokens} rows")
        if topk_local.dim() != 2 or topk_local.shape[1] > self.config.index_topk:
            raise ValueError(f"topk_local must be [n, K<={self.config.index_topk}], got {tuple(topk_local.shape)}")
        cm = step.compressed[4]
        # Validated once per step by build(); the per-layer call only masks by each token's own
        # entry count (cm.lengths), so no index reaches past the request's real entries.
        return ops.compute_global_topk_indices_and_lens(
            topk_local, step.token_to_req[:n], cm.block_table, cm.block_size, step.is_valid_token[:n],
            self.c4_global_topk, self.c4_topk_lens, cm.lengths, validate=False, impl=impl,
        )
