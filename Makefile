# hpcrl: `make demo` runs the whole system locally; `make test` runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVICES := services/benchmarker services/sqd_scheduler services/learner services/generator
TOOLS := tools/bootstrap tools/evaluate
# Outside trainers' client of the benchmarker fleet (no torch, no vLLM).
CLIENTS := libs/reward_client
PACKAGES := libs/common $(SERVICES) $(TOOLS) $(CLIENTS)
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))

.PHONY: install install-swift system test test-fast lint demo clean help

help:
	@echo "make install  - system packages, RabbitMQ, .venv with every package (editable)"
	@echo "make test     - install, then run the whole test suite"
	@echo "make test-fast - the fast tier (about 2 min on 2 cores): no broker, no vLLM, no demo, no drills"
	@echo "make lint     - ruff check and ruff format --check"
	@echo "make demo     - install, then run the whole system locally (DEMO_ARGS=--fresh to restart)"
	@echo "make install-swift - optional: the ms-swift learner backend's own venv (.venv-swift)"

install: system $(STAMP)
	@# vLLM's CPU build pulls GPU builds of torchvision/torchaudio/triton that break
	@# `import vllm`; the script removes them, every time (a no-op when vLLM imports).
	@bash deploy/local/install-vllm.sh

system:
	@bash deploy/local/ensure-system.sh

$(STAMP): $(PYPROJECTS) requirements-dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -r requirements-dev.txt $(addprefix -e ,$(SERVICES) $(CLIENTS))
	@# Services name libs/common by path (so `pip install ./services/X` works alone); that
	@# installs it as a copy, so make it editable again last. The tools name services by path
	@# too, which pip refuses beside the same services installed editable: their other
	@# requirements are the services' and requirements-dev's, so --no-deps.
	$(BIN)/python -m pip install -q --no-deps -e libs/common $(addprefix -e ,$(TOOLS))
	@touch $@

install-swift: install
	bash deploy/local/install-swift.sh

test: install
	$(BIN)/python -m pytest

# The fast tier: tests marked neither `slow` nor `broker` (so no RabbitMQ is needed), less the
# suites that train or load a model, drill the sandbox (timing, threads), fuzz the lexer
# against gcc or build a measured catalogue. `make test` runs all of them; CI runs `make test`.
FAST_LEAVE_OUT := tests/fleet tests/demo/test_demo_e2e.py tests/generator/test_vllm_backend.py \
	tests/observability/test_prometheus.py tests/scheduler/test_integration.py \
	tests/learner/test_trainer.py tests/generator/test_transformers_backend.py \
	tests/benchmarker/test_fast_path.py tests/benchmarker/test_replicas.py \
	tests/benchmarker/test_sandbox.py tests/benchmarker/test_threads.py \
	tests/common/test_csource_gcc.py tests/bootstrap/test_tokenizer.py \
	tests/bootstrap/test_examples.py tests/bootstrap/test_kernels_compile.py

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not broker" $(addprefix --ignore=,$(FAST_LEAVE_OUT))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

demo: install
	$(BIN)/python deploy/local/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
