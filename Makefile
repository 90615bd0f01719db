# `make run` and `make test` work on a fresh machine: they create .venv and install what the project needs.
# Where there is no NVIDIA GPU, torch is pinned to the CPU build (a bare `torch` would pull a multi-GB CUDA build).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH := $(if $(HAS_NVIDIA),torch,torch==2.13.0)

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/offload-engine demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/offload-engine bench

clean:
	rm -rf $(VENV) build *.egg-info
