"""Per-step metadata: the batch description and the builders shared by all layers of a step.

Interface contract with the sparse-attention op (both sides follow it). A candidate set is read
from one paged cache in one of two forms:

* indices form: ``indices [T, width] int32`` of GLOBAL slot ids (``block_id * block_size +
  offset``, -1 = hole) plus ``lengths [T] int32``; candidate j of token t is valid iff
  ``j < lengths[t]`` and ``indices[t, j] >= 0``; entries at or past ``lengths[t]`` are never read.
* range form: ``block_table [R, max_blocks] int32``, ``token_to_req [T]``, ``starts [T]``,
  ``lengths [T]`` (int32): token t sees entries ``starts[t] .. starts[t] + lengths[t] - 1`` of
  its request's stream at slot ``block_table[req, e // block_size] * block_size + e %
  block_size``. SWA: starts = max(0, p-W+1), lengths = min(p+1, W); C128A: starts = 0,
  lengths = (p+1)//128; padded tokens (slot_mapping -1) get lengths 0.

``block_size`` counts ENTRIES physically stored per block (SWA 64, C4A compressed 64, C128A 2).
"""

from dsv4attn.metadata.batch import (
    GROUP_C4,
    GROUP_C128,
    BatchMetadata,
    split_decodes_and_prefills,
)
from dsv4attn.kv_cache.specs import GROUP_FULL_MLA, GROUP_SWA, GROUPS
from dsv4attn.metadata.builders import (
    FORMS,
    CompressedMetadata,
    MetadataConfig,
    StepMetadata,
    StepMetadataBuilder,
    SWAMetadata,
    metadata_bytes_written,
)

__all__ = [
    "GROUP_C4",
    "GROUP_C128",
    "GROUP_FULL_MLA",
    "GROUP_SWA",
    "GROUPS",
    "FORMS",
    "BatchMetadata",
    "CompressedMetadata",
    "MetadataConfig",
    "StepMetadata",
    "StepMetadataBuilder",
    "SWAMetadata",
    "metadata_bytes_written",
    "split_decodes_and_prefills",
]
