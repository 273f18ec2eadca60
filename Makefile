# One-command set-up: `make lab` (JupyterLab with the monarch kernel) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup lab test test-fast test-unit bench gpu-wheels lint clean labextension docs docs-serve \
	notebooks

# The JupyterLab extension (labextension/, TypeScript) is prebuilt by the package build itself
# (hatch-jupyter-builder, see pyproject.toml): `pip install -e .` (or `pip install .`, or a
# wheel) builds it into monarch_kernel/labextension/ and installs it into the environment's
# share/jupyter/labextensions/; node is the only tool it needs besides the Python build deps.
# YARN_ENABLE_IMMUTABLE_INSTALLS: that build uses the committed yarn.lock as it is.
LABEXT := monarch_kernel/labextension/package.json
LABEXT_SRC := $(wildcard labextension/src/*.ts labextension/style/*) \
	labextension/package.json labextension/yarn.lock labextension/tsconfig.json

setup: $(STAMP) $(LABEXT)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	YARN_ENABLE_IMMUTABLE_INSTALLS=true $(PIP) install -q -e '.[test]'
	$(PY) -m monarch_kernel install --sys-prefix
	rm -f $(VENV)/.installed-*
	touch $@

# Development: rebuild the extension after editing labextension/ (no reinstall needed);
# `monarch_kernel install --sys-prefix` copies it into the environment again.
labextension: $(LABEXT)

$(LABEXT): $(LABEXT_SRC) | $(STAMP)
	cd labextension && CI=true $(CURDIR)/$(VENV)/bin/jlpm install --immutable
	cd labextension && PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(CURDIR)/$(VENV)/bin/jlpm build
	$(PY) -m monarch_kernel install --sys-prefix
	touch $@

# JupyterLab refuses to run as root without --allow-root (containers, cloud studios).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

# LAB_ARGS: more JupyterLab options, e.g. make lab LAB_ARGS="--no-browser --port 8899"
LAB_ARGS ?=

lab: setup
	$(PY) -m jupyter lab --ip 127.0.0.1 $(ALLOW_ROOT) $(LAB_ARGS) notebooks/01-quickstart.ipynb

# Style first (ruff), types beside the tests (below). Two pytest-xdist
# workers: most tests wait on kernels, ranks and sockets, and one worker left a 2-core
# machine half idle. tests/conftest.py schedules them: a module's tests on one worker, in
# order, and the Ray and Slurm modules together. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

# The type checker (about a minute from a cold cache, on one core) runs beside the tests,
# which leave a core partly idle, and fails the run as lint would; ruff (seconds) first.
test: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	@$(PY) -m mypy > $(VENV)/mypy.out 2>&1 & mypy=$$!; \
	$(PY) -m pytest $(XDIST); status=$$?; \
	if wait $$mypy; then tail -n 1 $(VENV)/mypy.out; \
	else cat $(VENV)/mypy.out; echo "make test: mypy failed"; status=1; fi; \
	exit $$status

# The lanes (pytest markers, docs/contributing.md "Test lanes"), without lint: test-fast is
# everything that needs no cluster and no browser (unit + local), test-unit the pure-Python
# tests.
test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not cluster and not browser"

test-unit: setup
	$(PY) -m pytest -m unit

# The documentation site (docs/, Sphinx + MyST-NB): warnings are errors (-W), every
# cross-reference must resolve (-n), and docs/_ext/mk_docs.py fails the build for a public
# name without a docstring. `make test` builds it too (tests/test_docs.py).
DOCS_OUT := docs/_build/html
DOCS_PORT ?= 8000

docs: setup
	$(PY) -m sphinx -W --keep-going -n -b html docs $(DOCS_OUT)

docs-serve: docs
	@echo "serving $(DOCS_OUT) on http://127.0.0.1:$(DOCS_PORT)/"
	$(PY) -m http.server --bind 127.0.0.1 --directory $(DOCS_OUT) $(DOCS_PORT)

# The notebooks' stored outputs (what the docs pages show): each tutorial executed again by
# the test that checks it, its outputs kept once the checks pass (tests/notebook_outputs.py).
# The Ray notebook runs against the test's own Ray cluster. Commit the notebooks after it.
NOTEBOOK_TESTS := tests/test_notebooks.py \
	tests/test_lightning.py::test_studio_notebook_runs_outside_a_studio \
	tests/test_ray.py::test_ray_notebook_runs_against_the_test_cluster

notebooks: setup
	MONARCH_KERNEL_KEEP_NOTEBOOK_OUTPUTS=1 $(PY) -m pytest -q -p no:randomly $(NOTEBOOK_TESTS)

bench: setup
	$(PIP) install -q -e '.[test,bench]'
	$(PY) -m bench
	$(PY) -m bench scale
	$(PY) -m bench telemetry
	$(PY) -m bench tensor_engine
	$(PY) -m bench hsdp

# The wheels the GPU machine lacks (bench/gpu_wheels.txt) into .whl/, for `bash
# bench/gpu_check.sh` there (README "Benchmarks").
gpu-wheels:
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bash bench/gpu_wheels.sh

LINT_PATHS := monarch_kernel tests bench docs/conf.py docs/_ext

lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) *.egg-info build dist .pytest_cache test-artifacts monarch_kernel/labextension \
		docs/_build \
		labextension/node_modules labextension/lib labextension/tsconfig.tsbuildinfo
