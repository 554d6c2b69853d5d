"""Test oracles and tolerance rules, importable by the test suite, scripts and other projects.

- :mod:`dsv4attn.testing.hf_oracle`: the Hugging Face ``transformers`` DeepseekV4Attention as
  the math oracle (small configs, deterministic weights, chunked reference runs). Needs the
  ``test`` extra (``transformers``), imported lazily.
- :mod:`dsv4attn.testing.attention_oracle`: adversarial candidate sets (permuted block tables,
  NaN-poisoned unused pages, sentinel block-table columns, -1 holes) and a plain-Python fp64
  oracle of the sparse MLA attention with sink.
- :mod:`dsv4attn.testing.triton_specs`: the Triton kernel specialisations (what a GPU compiles)
  of the launches a block of code makes, recorded on CPU under the interpreter.
- :mod:`dsv4attn.testing.stand_ins`: stand-ins for the attention kernels, so dispatch, launch
  caches and call plans run (and are timed) on CPU as they would on a GPU.
- :mod:`dsv4attn.testing.tolerance`: how results are compared (max-abs error relative to the
  reference's scale; the bf16 rule "our error <= factor x the reference's own bf16 error").

Nothing here is used on the serving path.
"""

from dsv4attn.testing.tolerance import assert_close_rel, assert_within_reference_error, max_rel_err

__all__ = ["assert_close_rel", "assert_within_reference_error", "max_rel_err"]
