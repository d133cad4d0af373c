# kvtier — two commands do all set-up on a fresh machine: `make run` and `make test`.
# `make run` needs the core environment only; `make test` also builds the SGLang test environment.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_PIN := torch==2.13.0
VENV_SGLANG := .venv-sglang
VENV_VLLM := .venv-vllm

.PHONY: install install-test run test lint unit docs docs-check clean

install: $(STAMP)

install-test: $(TEST_STAMP) $(VENV_SGLANG)/.installed $(VENV_VLLM)/.installed

# The core: what `kvtier serve` needs (the engine, the server, the Triton kernels).
# Each step says what it does first: a cold install takes minutes and pip is quiet.
$(STAMP): pyproject.toml
	@echo "kvtier: [1/4] creating the environment $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "kvtier: [2/4] upgrading pip"
	$(BIN)/python -m pip install -q --upgrade pip
	# Pin torch first: the CPU build installs from local disk; a bare `torch` pulls a CUDA build.
	@echo "kvtier: [3/4] installing $(TORCH_PIN) (the longest step)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	@echo "kvtier: [4/4] installing kvtier with the server (fastapi, uvicorn, transformers, triton)"
	$(BIN)/python -m pip install -q -e ".[serve,gpu]" "$(TORCH_PIN)"
	touch $(STAMP)
	@echo "kvtier: installed in $(VENV)"

# The test tools and the system packages the tests need (redis-server).
$(TEST_STAMP): $(STAMP) scripts/install_system_deps.sh
	bash scripts/install_system_deps.sh
	$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH_PIN)"
	touch $(TEST_STAMP)

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
# call it (curl and the openai client) once it listens. Ctrl-C stops it. More flags through ARGS:
# make run ARGS="--port 9000 --log-level debug".
ARGS ?=
run: install
	$(BIN)/kvtier serve --disk file://$(CURDIR)/data/disk $(ARGS)

# Type checks: strict on the core (its lower layers, the controller, the facade and the admin
# layer).
MYPY_STRICT := src/kvtier/keys.py src/kvtier/config.py src/kvtier/units.py src/kvtier/config_flags.py src/kvtier/layout.py src/kvtier/errors.py \
	src/kvtier/memory src/kvtier/index src/kvtier/store src/kvtier/transfer src/kvtier/controller \
	src/kvtier/cache.py src/kvtier/admin src/kvtier/config_doc.py

lint: install-test
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy --strict $(MYPY_STRICT)

unit: install-test
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

# The docs site (mkdocs.yml): `make docs` serves it on http://127.0.0.1:8001 and rebuilds on edits;
# `make docs-check` (part of `make test`) builds it with --strict into a temporary folder, so a
# broken link or anchor fails. The build takes a few seconds.
docs: $(TEST_STAMP)
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

docs-check: $(TEST_STAMP)
	@site=$$(mktemp -d) && $(BIN)/mkdocs build --strict --quiet --site-dir "$$site"; \
		status=$$?; rm -rf "$$site"; exit $$status

test: lint unit docs-check

clean:
	rm -rf $(VENV) $(VENV_SGLANG) $(VENV_VLLM) .pytest_cache .ruff_cache .mypy_cache .hypothesis
