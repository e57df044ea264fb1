# hpcrl: `make demo` runs the whole system locally; `make test` runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVICES := services/benchmarker services/sqd_scheduler services/learner services/generator
TOOLS := tools/bootstrap tools/evaluate
PACKAGES := libs/common $(SERVICES) $(TOOLS)
PYPROJECTS := $(addsuffix /pyproject.toml,$(PACKAGES))

.PHONY: install install-swift system test lint demo clean help

help:
	@echo "make install  - system packages, RabbitMQ, .venv with every package (editable)"
	@echo "make test     - install, then run the whole test suite"
	@echo "make lint     - ruff"
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
	$(BIN)/python -m pip install -q -r requirements-dev.txt $(addprefix -e ,$(SERVICES))
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

lint: install
	$(BIN)/ruff check .

demo: install
	$(BIN)/python deploy/local/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
