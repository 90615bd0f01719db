# `make run` and `make test` work on a fresh machine: they create .venv and install what the project needs.
# Where there is no NVIDIA GPU, torch is pinned to the CPU build (a bare `torch` would pull a multi-GB CUDA build).
# Where there is one, .venv also sees the packages of the python3 that made it (its system site-packages, and
# its own when that python3 is itself a venv), so a GPU host's preinstalled torch, triton and numba are used;
# there pip installs offline first (no index; setuptools from that python3) and goes to the index only if that fails.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HAS_NVIDIA := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH := $(if $(HAS_NVIDIA),torch,torch==2.13.0)
PIP_OFFLINE_FIRST := $(if $(HAS_NVIDIA),$(PY) -m pip install -q --no-index --no-build-isolation --use-pep517 \
	-e ".[test]" ||)
SITE_PACKAGES = $$($(PY) -c "import sysconfig; print(sysconfig.get_path('purelib'))")

.PHONY: install run test test-gpu bench clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	python3 -m venv $(if $(HAS_NVIDIA),--system-site-packages) $(VENV)
	$(if $(HAS_NVIDIA),python3 -c "import site; print('import site;', *(f'site.addsitedir({p!r});' \
		for p in site.getsitepackages()))" > "$(SITE_PACKAGES)/host-python3.pth")
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PIP_OFFLINE_FIRST) $(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/offload-engine demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# The suite on CUDA (docs/design.md, "Testing"): engines in every placement on the Triton path, the kernels natively.
# pytest's output also goes to benchmarks/results/<device>/gpu_tests.txt (the slug the benchmarks use), after a
# line naming the date, GPU and versions; the target's exit status is pytest's.
GPU_SLUG := from benchmarks.bench_throughput import device_slug; print(device_slug())
GPU_HEADER := import datetime, torch, triton; \
	print(f"\# make test-gpu, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, " \
	f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")

# GPU_TESTS: what pytest runs (all of tests/ by default); a part, e.g. GPU_TESTS="tests --ignore=tests/engine", lets
# the suite run in pieces where one command has a time limit.
GPU_TESTS ?= tests
test-gpu: SHELL := /bin/bash
test-gpu:
	@[ -n "$(HAS_NVIDIA)" ] || { echo "make test-gpu needs an NVIDIA GPU, and nvidia-smi -L finds none" \
		"(make test runs the suite on the CPU)" >&2; exit 1; }
	@$(MAKE) --no-print-directory install
	@set -o pipefail; \
	out=benchmarks/results/$$($(PY) -c '$(GPU_SLUG)')/gpu_tests.txt && mkdir -p "$$(dirname "$$out")" && \
	$(PY) -c '$(GPU_HEADER)' > "$$out" || exit 1; \
	OFFLOAD_ENGINE_TEST_DEVICE=cuda $(PY) -m pytest -v -rs $(GPU_TESTS) 2>&1 | tee -a "$$out"; \
	status=$$?; echo "make test-gpu: pytest exited $$status, output in $$out"; exit $$status

bench: $(STAMP)
	$(VENV)/bin/offload-engine bench

clean:
	rm -rf $(VENV) build *.egg-info
