# osp: `make test` installs everything it needs (see scripts/install.sh), then runs the tests.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
NVCC ?= $(shell command -v nvcc 2>/dev/null || ( [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc ))
CUDA_ARCHS := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
CUDA_SRCS := $(wildcard csrc/cuda/*.cu)
PYTEST_ARGS ?=

.PHONY: install test test-only lint cuda-check bench-kernels bench-accuracy demo bench stress-exit clean

install:
	@bash scripts/install.sh

test: install
	@if [ -n "$(NVCC)" ]; then $(MAKE) --no-print-directory cuda-check; else echo "cuda-check: no nvcc, skipped"; fi
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory test-only

test-only:
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

# A user's script that returns without any teardown must exit 0: 200 launches under torchrun and
# 200 under horovodrun, two at a time (about 30 minutes on 2 cores). `make test` runs 20 of each.
stress-exit: install
	OSP_EXIT_RUNS=200 $(PY) -m pytest -q -s tests/test_exit.py

lint:
	$(VENV)/bin/ruff check python tests bench

# Compile-check every CUDA file for sm_80 and sm_90 (works without a GPU).
cuda-check:
	@test -n "$(NVCC)" || { echo "cuda-check: nvcc not found (set NVCC=...)"; exit 1; }
	@mkdir -p build/cuda-check
	@for f in $(CUDA_SRCS); do \
	  echo "nvcc $$f"; \
	  $(NVCC) -std=c++17 -O3 $(CUDA_ARCHS) -c $$f -o build/cuda-check/$$(basename $$f).o || exit 1; \
	done
	@echo "cuda-check: $(words $(CUDA_SRCS)) files compiled for sm_80 and sm_90"

bench-kernels: install
	$(PY) bench/kernels.py

# Accuracy on digits: BSP vs OSP (0.25 and auto), 3 seeds, 2 ranks under horovodrun.
bench-accuracy: install
	$(PY) bench/accuracy.py

# Throughput under an emulated network bottleneck (needs root: network namespaces and tc).
# BENCH_ARGS=--quick for a few minutes on 2 cores.
BENCH_ARGS ?=
bench: install
	$(PY) bench/train_throughput.py $(BENCH_ARGS)

# Quick start: BSP then OSP on 2 ranks under horovodrun, then a side-by-side table.
HVDRUN := $(VENV)/bin/horovodrun --gloo -np 2 -H localhost:2
demo: install
	@mkdir -p runs
	$(HVDRUN) $(PY) -m osp.train --sync bsp --json runs/demo-bsp.json
	$(HVDRUN) $(PY) -m osp.train --sync osp --critical 0.25 --json runs/demo-osp.json
	@echo; $(PY) -m osp.report runs/demo-bsp.json runs/demo-osp.json

clean:
	rm -rf build python/osp/*.so python/*.egg-info
