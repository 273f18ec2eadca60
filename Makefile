# One-command set-up: `make lab` (JupyterLab with the monarch kernel) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup lab test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PY) -m monarch_kernel install --sys-prefix
	rm -f $(VENV)/.installed-*
	touch $@

# JupyterLab refuses to run as root without --allow-root (containers, cloud studios).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	$(PY) -m jupyter lab --ip 127.0.0.1 $(ALLOW_ROOT) notebooks/01-quickstart.ipynb

# Lint first: CI enforces style and types before the (slower) tests run.
test: lint
	$(PY) -m pytest

bench: setup
	$(PIP) install -q -e '.[test,bench]'
	$(PY) -m bench

lint: setup
	$(PY) -m ruff check monarch_kernel tests bench
	$(PY) -m ruff format --check monarch_kernel tests bench
	$(PY) -m mypy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache test-artifacts
