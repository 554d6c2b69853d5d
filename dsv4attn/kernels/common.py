"""Shared Triton helpers (@triton.jit only): addressing of the candidate-set contract and the
integer encoders of the page formats.

- :func:`entry_slot` / :func:`block_slot` (= :func:`block_id` then :func:`slot_of`): the
  entry -> block table -> slot formula of
  :mod:`dsv4attn.kv_cache.slots` with its one meaning of holes (slot -1; invalid lanes read
  column 0 of their row and never form an address outside the table).
- :func:`page_offset`: a slot's page offset and entry index in int64 (``block * stride``
  passes 2^31 for ~57K blocks of a 37,440 B page).
- :func:`round_to_bf16`, :func:`bf16_bits`, :func:`e4m3_encode`, :func:`pow2_exponent_for`,
  :func:`pow2`: float8 e4m3fn and bf16 encoded with integer operations on the fp32 bits (exact
  round-to-nearest-even, subnormals included), identical under the interpreter, on sm80 and sm90.
- :func:`e4m3_bits_ptx` (plain Python): the PTX lines of the GPU-only e4m3 -> bf16 decode that the
  indexer's and the sm90 attention kernel's inline assembly share.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: bf16x2 of 2^120 twice: the product that turns :func:`e4m3_bits_ptx`'s bf16 pair into the
#: e4m3 values (exact; with ``BF16X2_NEG_ZERO`` as the fma's addend, +-0 keep their sign).
BF16X2_2POW120 = "0x7B807B80"
BF16X2_NEG_ZERO = "0x80008000"


def e4m3_bits_ptx(a: str, b: str, sel: str) -> str:
    """PTX lines leaving in ``y`` (``s`` is scratch; the caller declares both .b32) the bf16 pair
    whose values are two e4m3 bytes times 2^-120: ``prmt`` with selector ``sel`` puts the bytes
    (from words ``a`` / ``b``) in bits 8-15 and 24-31; a byte's sign is then the bf16 sign, and
    its 7 other bits, shifted right by 4, the low 4 exponent and top 3 mantissa bits (bf16 keeps
    fp32's exponent range, so e4m3 subnormals are exact too). An fma by :data:`BF16X2_2POW120`
    finishes the decode, exactly; 0x7F / 0xFF (e4m3's NaN) decode to +-480. Integer moves only:
    the conversion unit stays free (docs/benchmarks.md, Tables 44 and 47)."""
    return (f"prmt.b32 y, {a}, {b}, {sel}; shr.b32 s, y, 4; and.b32 s, s, 0x07F007F0; "
            "and.b32 y, y, 0x80008000; or.b32 y, y, s; ")


@triton.jit
def block_id(bt_ptr, req, col, valid, stride_bt_req, stride_bt_col, max_blocks):
    """``block_table[req, col]``: the one memory read of the slot formula, -1 where ``valid``
    is false or the column is outside ``[0, max_blocks)`` (no address outside the table is
    formed). Kernels that pipeline their gathers issue it early and finish with :func:`slot_of`."""
    valid = valid & (col >= 0) & (col < max_blocks)
    col = tl.where(valid, col, 0)
    return tl.load(bt_ptr + req.to(tl.int64) * stride_bt_req + col.to(tl.int64) * stride_bt_col,
                   mask=valid, other=-1)


@triton.jit
def slot_of(blk, off, block_size):
    """Slot (int64, -1 for holes) of offset ``off`` in block ``blk`` (a negative id is a hole),
    and its validity."""
    valid = blk >= 0
    slot = blk.to(tl.int64) * block_size + off.to(tl.int64)
    return tl.where(valid, slot, -1), valid


@triton.jit
def block_slot(bt_ptr, req, col, off, valid, stride_bt_req, stride_bt_col, max_blocks, block_size):
    """``block_table[req, col] * block_size + off`` (int64) and its validity: ``valid``, the column
    inside ``[0, max_blocks)`` and a block id >= 0. Holes get slot -1."""
    return slot_of(block_id(bt_ptr, req, col, valid, stride_bt_req, stride_bt_col, max_blocks), off, block_size)


@triton.jit
def entry_slot(bt_ptr, req, e, valid, stride_bt_req, stride_bt_col, max_blocks, block_size):
    """Global slot (int64, -1 for holes) of entry ``e`` of request ``req``, and its validity."""
    valid = valid & (e >= 0)
    ee = tl.where(valid, e, 0)
    return block_slot(bt_ptr, req, ee // block_size, ee % block_size, valid, stride_bt_req, stride_bt_col,
                      max_blocks, block_size)


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 holding the nearest bf16 (RNE; finite inputs)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x):
    """fp32 holding a bf16 value -> its 16 bits as int32 (0..65535)."""
    return (x.to(tl.int32, bitcast=True) >> 16) & 0xFFFF


@triton.jit
def e4m3_encode(y):
    """fp32 in [-448, 448] -> e4m3fn byte (int32 0..255), round-to-nearest-even."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # Normal range (|y| >= 2^-6): RNE on the top 3 mantissa bits, re-bias exponent 127 -> 7.
    norm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: k = RNE(|y| * 2^9), k in 0..8 (8 encodes 2^-6, the smallest normal).
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(141 - e, 30)
    s = tl.maximum(s, 1)
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    k = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return tl.where(a >= 0x3C800000, norm, k) | sign


@triton.jit
def pow2_exponent_for(amax):
    """ceil(log2(amax / 448)) for finite amax >= 1e-4, exactly, from the fp32 bits.

    amax = m * 2^E with m in [1, 2): amax / 448 = (m / 1.75) * 2^(E-8), so the result is E-8,
    plus 1 when m > 1.75 (mantissa bits > 0x600000).
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - 8
    return e + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def pow2(e):
    """2^e as fp32 for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def page_offset(slot, block_size, stride_block):
    """(offset of the slot's page from the cache base, entry index in the block), in int64:
    ``(slot // block_size) * stride_block`` passes 2^31 for ~57K blocks of a 37,440 B page."""
    slot = slot.to(tl.int64)
    return (slot // block_size) * stride_block, slot % block_size
