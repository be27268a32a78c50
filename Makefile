# Two entry points (see README): `make demo` runs the main job, `make test` the whole suite.
# Both create .venv on first use and install CPU torch pinned to the build on this kind of machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_SPEC)"
	$(VENV)/bin/jupyter kernelspec install --sys-prefix --name distnb jupyter-config/kernels/distnb >/dev/null
	touch $@

.PHONY: install demo test bench
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m distnb.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.installed
	$(PY) benchmarks/run.py
