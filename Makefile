# Two entry points (see README): `make demo` runs the main job, `make test` the whole suite; `make docs` builds docs/.
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

.PHONY: install demo test bench docs chromium multihost slurm
install: $(VENV)/.installed

# The browser test (tests/browser) drives Debian's Chromium through playwright (pip, in the test
# extra); playwright's own browser download is never used. Installed when missing (needs root or sudo).
CHROMIUM ?= /usr/bin/chromium
chromium:
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium for the browser test"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	  || echo "warning: could not install chromium; the browser test will be skipped"; }

# tests/multihost: sshd and iproute2 (test hosts in network namespaces) and Open MPI (the MPI launcher
# test), installed with apt when missing (needs root or sudo; without them those tests skip).
multihost:
	@sh .ci/install-multihost.sh

# tests/multihost/test_slurm.py: Slurm (slurmctld, slurmd, the client commands) and munge, installed with apt
# when missing; no service is started (the tests run their own daemons inside the test hosts' namespaces).
slurm:
	@sh .ci/install-slurm.sh

demo: $(VENV)/.installed
	$(PY) -m distnb.tools.demo

test: $(VENV)/.installed chromium multihost slurm
	$(PY) -m pytest -q -p no:cacheprovider

# The documentation (docs/, Sphinx): warnings and broken references fail it, as in tests/docs.
# Open docs/_build/html/index.html. The test extra holds the docs extra's packages.
docs: $(VENV)/.installed
	$(PY) -m sphinx -W --keep-going -n -b html docs docs/_build/html

# Benchmark-only extra (Accelerate, the launcher reference), installed with the pinned torch so pip keeps it.
$(VENV)/.bench-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[bench]" "$(TORCH_SPEC)"
	touch $@

bench: $(VENV)/.bench-installed
	$(PY) benchmarks/run.py
