"""Candidate sets of the sparse MLA attention: which cache entries one query token attends to.

A :class:`CandidateSet` names one paged cache and, per query token, the entries of it that the
token sees, in one of two forms (the metadata contract shared with ``dsv4attn.metadata``):

* **indices form**: ``indices [num_tokens, width]`` int32 GLOBAL slot ids
  (``slot = block_id * block_size + offset``; -1 = hole) and ``lengths [num_tokens]`` int32.
  Candidate ``j`` of token ``t`` is valid iff ``j < lengths[t]`` and ``indices[t, j] >= 0``;
  entries at or beyond ``lengths[t]`` are never read (a length beyond ``width`` means the
  whole row; ``lengths=None`` means whole rows for every token, with no vector to allocate).
* **range form**: ``block_table [num_reqs, max_blocks]``, ``token_to_req [num_tokens]``,
  ``starts [num_tokens]``, ``lengths [num_tokens]`` (all int32). Token ``t`` sees entries
  ``e = starts[t] .. starts[t] + lengths[t] - 1`` of its request's stream, stored at slot
  ``block_table[req, e // block_size] * block_size + e % block_size``. A negative block-table
  entry, or a block column beyond ``block_table.shape[1]``, makes that candidate invalid (it
  is never dereferenced). A token whose ``token_to_req`` is no row of the block table has no
  candidates in the set. The work per token is bounded by the table: entries outside
  ``[0, block_table.shape[1] * block_size)`` are invalid whatever ``starts``/``lengths`` say.

In both forms a slot at or beyond the cache capacity (``num_blocks * block_size``) counts as
invalid too, so a bad index can never address memory outside the cache.

Caches: ``fp8_ds_mla`` uint8 views ``(num_blocks, block_size, entry_bytes)`` whose block stride is
at least ``block_size * entry_bytes`` (the padded pages of :mod:`dsv4attn.kv_cache.layout`, or
a contiguous layout as engines' tests allocate), or plain bf16 pages
``(num_blocks, block_size, head_dim)`` whose last dim is contiguous.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsv4attn._checks import check_tensor
from dsv4attn.kv_cache.layout import PRODUCTION_LAYOUT, FP8DSMLALayout


#: Most entries one token can see in one set (index width, or block-table columns x block
#: size): keeps every entry position and chunk offset of the kernels inside int32.
MAX_ENTRIES = 1 << 30


@dataclass(frozen=True)
class CandidateSet:
    """One cache plus the per-token candidate description (indices form or range form).

    Fields: ``cache`` (fp8_ds_mla uint8 view or bf16 pages), ``lengths [num_tokens]`` int32
    (indices form only: ``None`` = every row whole),
    and either ``indices [num_tokens, width]`` int32 (indices form) or ``block_table
    [num_reqs, max_blocks]`` + ``token_to_req [num_tokens]`` + ``starts [num_tokens]`` int32
    (range form). ``layout`` gives the NoPE/RoPE split of an fp8 cache; ``None`` infers it
    from the query head_dim and the cache's entry bytes (production 448 + 64 first).
    """

    cache: torch.Tensor
    lengths: torch.Tensor | None
    indices: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    token_to_req: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    layout: FP8DSMLALayout | None = None

    @property
    def is_range(self) -> bool:
        return self.indices is None

    @property
    def is_fp8(self) -> bool:
        return self.cache.dtype == torch.uint8

    @property
    def block_size(self) -> int:
        return int(self.cache.shape[1])

    @property
    def capacity(self) -> int:
        """Number of addressable slots: ``num_blocks * block_size``."""
        return int(self.cache.shape[0]) * int(self.cache.shape[1])


def infer_layout(head_dim: int, entry_bytes: int) -> FP8DSMLALayout:
    """The fp8_ds_mla layout with ``head_dim`` dims and ``entry_bytes`` bytes per entry.

    Prefers the production split (rope 64); raises ``ValueError`` when none fits.
    """
    order = [64] + [r for r in range(0, head_dim, 2) if r != 64]
    for rope in order:
        nope = head_dim - rope
        if nope <= 0 or nope % 64:
            continue
        lay = FP8DSMLALayout(nope_dim=nope, rope_dim=rope)
        if lay.entry_bytes == entry_bytes:
            return lay
    raise ValueError(f"no fp8_ds_mla layout has head_dim {head_dim} and {entry_bytes} bytes per entry")


def resolve_layout(s: CandidateSet, head_dim: int, name: str) -> FP8DSMLALayout | None:
    """Layout of an fp8 set (``None`` for bf16 pages); checks it against ``head_dim``."""
    if not s.is_fp8:
        return None
    return layout_for(s.layout, head_dim, int(s.cache.shape[2]), name)


@functools.lru_cache(maxsize=512)
def layout_for(layout: FP8DSMLALayout | None, head_dim: int, entry_bytes: int, name: str) -> FP8DSMLALayout:
    """The fp8 layout of a set: ``layout`` if given, else the one inferred from ``head_dim`` and
    ``entry_bytes``; ``ValueError`` naming ``name`` when it does not match ``head_dim``.
    A pure function, cached (LRU) because every attention call asks it; errors are not cached."""
    lay = layout
    if lay is None:
        if head_dim == PRODUCTION_LAYOUT.head_dim and entry_bytes == PRODUCTION_LAYOUT.entry_bytes:
            lay = PRODUCTION_LAYOUT
        else:
            lay = infer_layout(head_dim, entry_bytes)
    if lay.head_dim != head_dim:
        raise ValueError(f"{name}.layout head_dim {lay.head_dim} does not match q head_dim {head_dim}")
    return lay


def check_candidate_set(name: str, s: object, num_tokens: int, head_dim: int, device: torch.device) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``s`` is a valid set for the query."""
    if not isinstance(s, CandidateSet):
        raise TypeError(f"{name} must be a CandidateSet, got {type(s).__name__}")
    cache = s.cache
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name}.cache must be a torch.Tensor, got {type(cache).__name__}")
    if cache.device != device:
        raise ValueError(f"{name}.cache must be on {device}, got {cache.device}")
    if s.layout is not None and not isinstance(s.layout, FP8DSMLALayout):
        raise TypeError(f"{name}.layout must be an FP8DSMLALayout or None, got {type(s.layout).__name__}")
    if cache.dtype == torch.uint8:
        if cache.dim() != 3:
            raise ValueError(f"{name}.cache must be a 3-D (num_blocks, block_size, entry_bytes) uint8 view, "
                             f"got shape {tuple(cache.shape)}")
        layout = resolve_layout(s, head_dim, name)
        assert layout is not None  # uint8 cache: an fp8 set always resolves a layout
        entry_bytes = layout.entry_bytes
        if cache.shape[2] != entry_bytes or cache.stride(2) != 1:
            raise ValueError(f"{name}.cache must be a (num_blocks, block_size, {entry_bytes}) uint8 view with "
                             f"contiguous bytes, got shape {tuple(cache.shape)} strides {cache.stride()}")
        # The kernels read block_size * entry_bytes bytes per block: the padded page stride of
        # dsv4attn's allocator or a contiguous layout (engines' tests) both qualify.
        if cache.shape[0] > 1 and cache.stride(0) < cache.shape[1] * entry_bytes:
            raise ValueError(f"{name}.cache block stride {cache.stride(0)} is smaller than a block's "
                             f"{cache.shape[1] * entry_bytes} bytes")
        if cache.data_ptr() % 4 or (cache.shape[0] > 1 and cache.stride(0) % 4):
            # Kernels read entries as 32-bit words; real pages are 576-byte aligned.
            raise ValueError(f"{name}.cache pages must be 4-byte aligned (data_ptr and stride(0))")
        if cache.shape[1] > 1 and cache.stride(1) != entry_bytes:
            # The view's middle dim is cosmetic, but a reshape would break the byte layout.
            raise ValueError(f"{name}.cache stride(1) must be {entry_bytes}, got {cache.stride(1)}")
    elif cache.dtype in (torch.bfloat16, torch.float32):
        # "auto" pages hold the model dtype: bf16 in serving, fp32 for exact-parity runs.
        check_tensor(f"{name}.cache", cache, ndim=3)
        if cache.shape[2] != head_dim:
            raise ValueError(f"{name}.cache last dim must be head_dim={head_dim}, got {tuple(cache.shape)}")
        if cache.stride(2) != 1:
            raise ValueError(f"{name}.cache last dim must be contiguous, got strides {cache.stride()}")
    else:
        raise TypeError(f"{name}.cache must be uint8 (fp8_ds_mla), bfloat16 or float32 pages, got {cache.dtype}")
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        raise ValueError(f"{name}.cache must hold at least one entry, got shape {tuple(cache.shape)}")
    i32 = torch.int32
    if s.lengths is not None or s.indices is None:  # None: indices form with whole rows
        check_tensor(f"{name}.lengths", s.lengths, dtype=i32, shape=(num_tokens,), device=device)
    if s.indices is not None:
        for extra in ("block_table", "token_to_req", "starts"):
            if getattr(s, extra) is not None:
                raise ValueError(f"{name}: give either indices (indices form) or {extra} (range form), not both")
        check_tensor(f"{name}.indices", s.indices, dtype=i32, ndim=2, device=device)
        if s.indices.shape[0] != num_tokens:
            raise ValueError(f"{name}.indices must have {num_tokens} rows, got shape {tuple(s.indices.shape)}")
        if s.indices.shape[1] > 0 and s.indices.stride(1) != 1:
            raise ValueError(f"{name}.indices rows must be contiguous, got strides {s.indices.stride()}")
        if s.indices.shape[1] > MAX_ENTRIES:
            raise ValueError(f"{name}.indices width {s.indices.shape[1]} exceeds {MAX_ENTRIES} candidates per token")
    else:
        for extra in ("block_table", "token_to_req", "starts"):
            if getattr(s, extra) is None:
                raise ValueError(f"{name}: range form needs {extra} (or give indices for the indices form)")
        block_table = check_tensor(f"{name}.block_table", s.block_table, dtype=i32, ndim=2, device=device)
        if block_table.shape[1] > 0 and block_table.stride(1) != 1:
            raise ValueError(f"{name}.block_table rows must be contiguous, got strides {block_table.stride()}")
        # token_to_req values are not range-checked (that would need a host sync per layer): a
        # value that is no block-table row means "no candidates" in the kernels and the reference.
        check_tensor(f"{name}.token_to_req", s.token_to_req, dtype=i32, shape=(num_tokens,), device=device)
        check_tensor(f"{name}.starts", s.starts, dtype=i32, shape=(num_tokens,), device=device)
        span = block_table.shape[1] * int(cache.shape[1])
        if span > MAX_ENTRIES:
            raise ValueError(f"{name}.block_table spans {span} entries per request (block_table.shape[1] x "
                             f"block_size); at most {MAX_ENTRIES} are supported")
