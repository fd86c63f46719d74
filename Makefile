# Two commands do all set-up: `make lenet` runs the book's experiment, `make test` the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# XLA:CPU spends a third of its time in page faults under glibc malloc; tcmalloc avoids them.
RUN := LD_PRELOAD=$$([ -e $(TCMALLOC) ] && echo $(TCMALLOC)) $(PY)

.PHONY: lenet resnet18 test setup
lenet: setup
	$(RUN) -m experiments.lenet

resnet18: setup
	$(RUN) -m experiments.resnet18

# Tests run in 4 processes (pytest-xdist), also on 2 cores: most of a test is compiling on one
# core, and a test waiting on its subprocesses or a timeout leaves its core to the others.
test: setup
	$(RUN) -m pytest -q -n 4 --dist worksteal

setup: $(VENV)/installed $(DATA) $(TCMALLOC)

$(VENV)/installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $@

$(DATA) $(TCMALLOC):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq dataset-fashion-mnist libtcmalloc-minimal4
