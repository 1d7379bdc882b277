# Two commands for a newcomer: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Debian's OpenBLAS makes fp32 matmul in mlx[cpu] ~15x faster than its bundled reference BLAS.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
PRELOAD := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),)
# setuptools' lenient editable mode maps tessera.engine -> engine/ (and server/, kernels/) with an import hook, so new
# modules are picked up without reinstalling; "compat" cannot map a package to another folder name at all.
EDITABLE := --config-settings editable_mode=lenient

.PHONY: serve test install install-test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e . $(EDITABLE)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -e '.[test]' $(EDITABLE)
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# `exec`: the server replaces the recipe's shell, so a SIGTERM to make (which make passes to its child) reaches
# the server itself; without it the shell dies and the server keeps running, orphaned.
serve: install
	exec env $(PRELOAD) $(VENV)/bin/tessera serve $(ARGS)

test: install-test
	exec env $(PRELOAD) $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
