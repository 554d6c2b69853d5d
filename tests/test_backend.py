"""Backend description: names, dtypes, block sizes, shapes, capability."""

import pytest
import torch

from dsv4attn.backend import BACKEND_NAME, DeepseekV4SparseBackend as B, normalize_kv_cache_dtype


def test_names_and_flags():
    assert B.get_name() == BACKEND_NAME == "FLASHMLA_SPARSE_DSV4"
    assert B.is_mla() is True and B.is_sparse() is True and B.supports_sink() is True
    assert not B.is_ssm() and not B.supports_non_causal() and B.supports_attn_type("decoder")
    assert B.supports_head_size(512) and not B.supports_head_size(576)
    assert B.supports_kv_cache_dtype("fp8") and B.supports_kv_cache_dtype(None) and not B.supports_kv_cache_dtype("fp4")
    assert B.supports_block_size(256) and B.supports_block_size(512) and not B.supports_block_size(64)
    assert B.supports_dtype(torch.bfloat16) and not B.supports_dtype(torch.float16)
    assert B.get_kv_cache_stride_order() == (0, 1, 2) and B.indexes_kv_by_block_stride()
    assert B.get_supported_dtypes() == (torch.bfloat16,)
    assert B.get_supported_kernel_block_sizes() == [256]
    assert (B.head_size, B.nope_dim, B.rope_dim) == (512, 448, 64)
    assert set(B.get_supported_kv_cache_dtypes()) == {"auto", "fp8_ds_mla"}


@pytest.mark.parametrize("alias,canon", [("fp8", "fp8_ds_mla"), ("fp8_ds_mla", "fp8_ds_mla"), ("auto", "auto")])
def test_dtype_aliases(alias, canon):
    assert normalize_kv_cache_dtype(alias) == canon


@pytest.mark.parametrize("bad", ["fp4", "int8", ""])
def test_unknown_cache_dtype_rejected(bad):
    with pytest.raises(ValueError, match="not supported"):
        normalize_kv_cache_dtype(bad)


def test_kv_cache_shapes():
    assert B.get_kv_cache_shape(10, 64, 1, 512, "fp8_ds_mla") == (10, 64, 584)
    assert B.get_kv_cache_shape(10, 64, 1, 512, "fp8") == (10, 64, 584)
    assert B.get_kv_cache_shape(10, 64, 1, 512, "auto") == (10, 64, 512)
    # Padded pages: 64 entries -> 37,440 B (65 * 576); 2 entries (C128A) -> 1,728 B (3 * 576).
    assert B.page_size_bytes(64, cache_dtype_str="fp8_ds_mla") == 37440 == 65 * 576
    assert B.page_size_bytes(2, cache_dtype_str="fp8_ds_mla") == 1728 == 3 * 576
    assert B.page_size_bytes(64, cache_dtype_str="auto") == 64 * 512 * 2


@pytest.mark.parametrize("args", [(0, 64, 1, 512), (10, 64, 2, 512), (10, -1, 1, 512)])
def test_kv_cache_shape_rejects_bad_args(args):
    with pytest.raises(ValueError):
        B.get_kv_cache_shape(*args, "fp8_ds_mla")


def test_capability():
    assert B.supports_compute_capability((8, 0)) and B.supports_compute_capability((9, 0))
    assert B.supports_compute_capability((12, 0))
    assert not B.supports_compute_capability((7, 5))
    cap = B.capability("cpu")
    assert "reference" in cap.paths
    if torch.cuda.is_available():
        cap = B.capability("cuda")
        assert cap.paths[0] == "triton"


def test_validate_configuration():
    assert B.validate_configuration(512, torch.bfloat16, "fp8", 256, 64) == []
    reasons = B.validate_configuration(256, torch.float16, "fp4", 100, 200)
    assert len(reasons) == 5


def test_validate_configuration_with_engine_flags():
    ok = B.validate_configuration(512, torch.bfloat16, "fp8_ds_mla", 256, use_mla=True, has_sink=True,
                                  use_sparse=True, use_mm_prefix=False, use_per_head_quant_scales=False,
                                  device_capability=(9, 0), attn_type="decoder")
    assert ok == []
    bad = B.validate_configuration(512, torch.bfloat16, "fp8_ds_mla", 256, use_mla=False, use_sparse=False,
                                   device_capability=(7, 5), attn_type="encoder")
    assert len(bad) == 4
    with pytest.raises(TypeError, match="unknown"):
        B.validate_configuration(512, torch.bfloat16, "auto", 256, use_magic=True)


def test_builder_class_builds_as_engines_call_it():
    from dsv4attn.metadata import BatchMetadata, MetadataConfig

    cls = B.get_builder_cls()
    builder = cls(MetadataConfig(max_num_batched_tokens=8, max_num_reqs=2, max_model_len=512, num_blocks=8,
                                 form="range"), "cpu")
    bt = torch.zeros(2, 8, dtype=torch.int32)
    batch = BatchMetadata.from_requests([1, 3], [5, 3], {"swa": bt, "full_mla": bt})
    step = builder.build(0, batch)
    assert isinstance(step, B.get_metadata_cls()) and step.swa.lengths.tolist() == [5, 1, 2, 3]
    with pytest.raises(ValueError, match="common_prefix_len"):
        builder.build(4, batch)
