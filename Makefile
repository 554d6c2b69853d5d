# Two entry points for a newcomer: `make demo` and `make test`.
# Both create .venv if it is missing; `make test` runs ruff, mypy, then pytest. torch is pinned
# to the CPU wheel for set-up on CPU machines; on a machine that already has a CUDA torch, use
# PYTHON=python3 to skip the venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,demo]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m dsv4attn generate --tiny 0 --check

# Kernel files whose CPU tests are replayed to record the Triton specialisations to compile.
COMPILE_CHECK_TESTS := tests/test_sparse_attn.py tests/test_sparse_attn_prefill.py tests/test_indexer_ops.py \
	tests/test_compressor_ops.py tests/test_kv_writers.py tests/test_metadata_ops.py tests/test_norm_rope.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider
	$(PY) -m scripts.compile_check record $(VENV)/kernel_specs.json $(COMPILE_CHECK_TESTS)
	$(PY) -m scripts.compile_check compile $(VENV)/kernel_specs.json --targets 80,90 --sm90

clean:
	rm -rf $(VENV)
