# kvbench: `make run` (main job on the packaged defaults) and `make test` (whole suite) on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvbench-installed
# the optional extras the tests need beyond the default install (hqq: latency.baselines=[transformers_quantized])
TEST_STAMP := $(VENV)/.kvbench-test-extras

.PHONY: install assets run test test-unit test-integration bench reproduce lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to 2.13.0 in pyproject.toml: pip takes the local CPU wheel, never a CUDA build
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,hqq]'
	touch $(TEST_STAMP)

assets: install
	$(PY) -m kvbench assets --model smollm2_135m --data sotu

run: assets
	$(PY) -m kvbench run +compressor=delta

test: assets $(TEST_STAMP)
	$(PY) -m pytest -q

test-unit: install $(TEST_STAMP)
	$(PY) -m pytest -q -m "not integration"

test-integration: assets $(TEST_STAMP)
	$(PY) -m pytest -q -m integration

bench: assets
	$(PY) scripts/bench_compressors.py

# results/README.md and its report from scratch, both packaged models (scripts/reproduce.sh; its wall time goes into
# the README's header and results/reproduce.log)
reproduce: assets $(TEST_STAMP)
	PY=$(PY) scripts/reproduce.sh

lint: install
	$(PY) -m ruff check kvbench compressors scripts tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
