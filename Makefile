# kvtier — two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
VENV_SGLANG := .venv-sglang
VENV_VLLM := .venv-vllm

.PHONY: install run test lint unit clean

install: $(STAMP) $(VENV_SGLANG)/.installed

$(STAMP): pyproject.toml scripts/install_system_deps.sh
	bash scripts/install_system_deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Pin torch first: the CPU build installs from local disk; a bare `torch` pulls a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH_PIN)"
	touch $(STAMP)

# SGLang 0.5.23 in its own environment, for the SGLang plug-in's tests. If it cannot be built here,
# tests/test_sglang_integration.py skips and says why.
$(VENV_SGLANG)/.installed: scripts/setup_sglang_env.sh pyproject.toml
	PYTHON=$(PYTHON) bash scripts/setup_sglang_env.sh $(VENV_SGLANG) \
		|| echo "warning: $(VENV_SGLANG) could not be built; the SGLang plug-in tests will skip"

# vLLM 0.32.0 (CPU build) in its own environment, for the vLLM plug-in's tests. If it cannot be
# built here, tests/test_vllm_integration.py skips and says why.
$(VENV_VLLM)/.installed: scripts/setup_vllm_env.sh pyproject.toml
	PYTHON=$(PYTHON) bash scripts/setup_vllm_env.sh $(VENV_VLLM) \
		|| echo "warning: $(VENV_VLLM) could not be built; the vLLM plug-in tests will skip"

# Serves the OpenAI API on the embedded tiny model, disk tier under ./data/disk; it prints how to
# call it (curl and the openai client) before it starts listening. Ctrl-C stops it.
run: install
	$(BIN)/kvtier serve --disk file://$(CURDIR)/data/disk

lint: install
	$(BIN)/ruff check src tests benchmarks

unit: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

test: $(VENV_VLLM)/.installed lint unit

clean:
	rm -rf $(VENV) $(VENV_SGLANG) $(VENV_VLLM) .pytest_cache .ruff_cache .hypothesis
