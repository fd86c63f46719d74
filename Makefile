# Two commands do all set-up: `make lenet` runs the book's experiment, `make test` the tests.
# Anywhere pip runs: a venv with the package; on Debian or Ubuntu, where apt-get may run
# without a password (as root, or with passwordless sudo), also Debian's Fashion-MNIST,
# tcmalloc, and Open MPI's mpirun and SLURM (for their test). Elsewhere the data is downloaded on
# first use (--data auto), and tcmalloc, a speed-up only, mpirun and SLURM are skipped: said
# once, never asked for.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
MPIRUN := /usr/bin/mpirun
SLURM := /usr/sbin/slurmctld
# apt-get as root, or through sudo only where it needs no password (-n never prompts).
APT := $(shell command -v apt-get >/dev/null 2>&1 && { [ "$$(id -u)" = 0 ] && echo apt-get \
	|| { sudo -n true 2>/dev/null && echo "sudo -n apt-get"; }; })
# XLA:CPU spends a third of its time in page faults under glibc malloc; tcmalloc avoids them.
RUN := LD_PRELOAD=$$([ -e $(TCMALLOC) ] && echo $(TCMALLOC)) $(PY)

.PHONY: lenet resnet18 test setup debian-packages
lenet: setup
	$(RUN) -m experiments.lenet

resnet18: setup
	$(RUN) -m experiments.resnet18

# Tests run in 4 processes (pytest-xdist), also on 2 cores: most of a test is compiling on one
# core, and a test waiting on its subprocesses or a timeout leaves its core to the others.
test: setup
	$(RUN) -m pytest -q -n 4 --dist worksteal

setup: $(VENV)/installed debian-packages

# A venv that fails to install is removed whole: the next make starts it afresh.
$(VENV)/installed: pyproject.toml
	@$(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip \
	  && $(PY) -m pip install -q -e '.[test,plot]' && touch $@ \
	  || { rm -rf $(VENV); echo "set-up: installing into $(VENV) failed (above); nothing was kept" >&2; exit 1; }

debian-packages:
	@if [ -e $(DATA) ] && [ -e $(TCMALLOC) ] && [ -e $(MPIRUN) ] && [ -e $(SLURM) ]; then :; \
	elif [ -n "$(APT)" ]; then $(APT) update -qq && DEBIAN_FRONTEND=noninteractive $(APT) install \
	  -y -qq dataset-fashion-mnist libtcmalloc-minimal4 openmpi-bin slurm-wlm \
	  || echo "set-up: apt-get could not install dataset-fashion-mnist, libtcmalloc-minimal4, \
	openmpi-bin and slurm-wlm; going on without them (the data is downloaded on first use)" >&2; \
	else echo "set-up: no apt-get without a password here: skipped Debian's dataset-fashion-mnist \
	(the data is downloaded on first use instead), tcmalloc (a speed-up only), openmpi-bin and \
	slurm-wlm (their test skips)" >&2; fi
