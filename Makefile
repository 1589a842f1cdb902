# osp: `make test` installs everything it needs (see scripts/install.sh), then runs the tests.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
NVCC ?= $(shell command -v nvcc 2>/dev/null || ( [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc ))
CUDA_ARCHS := -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
CUDA_SRCS := $(wildcard csrc/cuda/*.cu)
CUDA_CPP_SRCS := $(wildcard csrc/cuda/*.cpp)
PYTEST_ARGS ?=

.PHONY: install test test-only test-jobs test-without-horovod lint cuda-check gpu-check bench-kernels bench-accuracy bench-stragglers bench-stragglers-net bench-lightning bench-faults bench-plan bench-tta bench-compression demo check-slow-rank bench stress-exit mutation conformance-random conformance-features horovod-upstream clean

install:
	@bash scripts/install.sh

test: install
	@if [ -n "$(NVCC)" ]; then $(MAKE) --no-print-directory cuda-check; else echo "cuda-check: no nvcc, skipped"; fi
	@$(MAKE) --no-print-directory lint
	@$(MAKE) --no-print-directory test-only

test-only:
	$(PY) -m pytest -q -rs --durations=25 -m "not bench and not jobs" $(PYTEST_ARGS)

# The second tier, which CI runs after `make test` (.ci/run): the tests marked `jobs`, whole jobs under real
# launchers (the examples with the swap, Horovod Elastic and torchrun restarts, Lightning, Accelerate, Horovod's own
# tests, the exit sample; about 9 minutes on 2 cores).
test-jobs: install
	$(PY) -m pytest -q -rs --durations=25 -m "jobs and not bench" $(PYTEST_ARGS)

# The suite as a user without Horovod runs it (tests/nohorovod: every process finds no Horovod): osp, osp.horovod
# and everything but the Horovod engine must pass; the engine's tests skip, saying so (about 13 minutes).
test-without-horovod: install
	OSP_HIDE_HOROVOD=1 $(PY) -m pytest -q -rs $(PYTEST_ARGS)

# A user's script that returns without any teardown must exit 0: 200 launches under torchrun and
# 200 under horovodrun, two at a time (about 30 minutes on 2 cores). `make test` runs 10 of each.
stress-exit: install
	OSP_EXIT_RUNS=200 $(PY) -m pytest -q -s tests/test_exit.py

# The one-rank oracle on 2000 random training loops (hypothesis, a random seed; tests/test_conformance_random.py,
# about 6 minutes on 2 cores; `make test` runs 150 fixed ones). OSP_HYPOTHESIS_SEED=s replays a failure's seed.
conformance-random: install
	OSP_HYPOTHESIS_EXAMPLES=$${OSP_HYPOTHESIS_EXAMPLES:-2000} $(PY) -m pytest -q tests/test_conformance_random.py

# Mutation testing: small bugs planted one at a time in a copy of python/osp (tests/mutation.py), each against the
# fast tests chosen for it; fails under 95% killed (about 20 minutes; MUTATION_ARGS="--only ID" for one, "--list").
# The feature axis in full (tests/features.py): every mode x every feature x every loop pattern, SGD with
# momentum and AdamW, on the one-rank oracle (about 12000 cases, 10 minutes; `make test` runs the pairwise sample
# and every mode x feature on the plain loop).
conformance-features: install
	OSP_FEATURE_SWEEP=1 $(PY) -m pytest -q tests/test_conformance.py -k test_one_rank_equals_torch_optim

mutation: install
	$(PY) tests/mutation.py $(MUTATION_ARGS)

# Horovod 0.28.1's own test/parallel/test_torch.py (vendored unmodified, tests/third_party/horovod/) against
# osp.horovod: all 115 TorchTests on 2 ranks under torchrun, CPU (2 to 4 minutes on 2 cores); writes
# docs/horovod-tests.md and fails where an outcome of expected.json got worse. `make test` runs its passed and
# refused tests only (tests/test_horovod_upstream.py, under a minute). HVD_UPSTREAM_ARGS="--write-expected" re-measures
# expected.json.
horovod-upstream: install
	$(PY) tests/third_party/horovod/table.py $(HVD_UPSTREAM_ARGS)

lint:
	$(VENV)/bin/ruff check python tests bench examples

# Compile-check every CUDA file for sm_80 and sm_90, and the CUDA op registration against torch's
# headers (works without a GPU and with a CPU-only torch: the one header a CPU build does not
# generate, c10's cuda_cmake_macros.h, is stubbed).
CUDA_RUNTIME_H = $(firstword $(wildcard $(CUDA_HOME)/include/cuda_runtime_api.h \
  /usr/local/cuda/include/cuda_runtime_api.h $(patsubst %/bin/nvcc,%,$(realpath $(NVCC)))/include/cuda_runtime_api.h))
cuda-check: install
	@test -n "$(NVCC)" || { echo "cuda-check: nvcc not found (set NVCC=...)"; exit 1; }
	@test -n "$(CUDA_RUNTIME_H)" || { echo "cuda-check: CUDA headers not found (set CUDA_HOME=...)"; exit 1; }
	@mkdir -p build/cuda-check/stub/c10/cuda/impl
	@for f in $(CUDA_SRCS); do \
	  echo "nvcc $$f"; \
	  $(NVCC) -std=c++17 -O3 $(CUDA_ARCHS) -c $$f -o build/cuda-check/$$(basename $$f).o || exit 1; \
	done
	@printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > build/cuda-check/stub/c10/cuda/impl/cuda_cmake_macros.h
	@T=$$($(PY) -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))"); \
	for f in $(CUDA_CPP_SRCS); do \
	  echo "c++ -fsyntax-only $$f"; \
	  $(CXX) -std=c++17 -fsyntax-only -Wno-c++20-extensions -Ibuild/cuda-check/stub $$T -I$(dir $(CUDA_RUNTIME_H)) $$f || exit 1; \
	done
	@echo "cuda-check: $(words $(CUDA_SRCS)) CUDA files compiled for sm_80 and sm_90, $(words $(CUDA_CPP_SRCS)) registration file(s) checked"

# On a host with one NVIDIA GPU, from the checkout alone (no install, no network; about 10 minutes):
# osp._C built in place with FORCE_CUDA=1 for the device's arch, the CUDA tests (test_ops.py -k cuda,
# test_optimizer.py -k cuda, test_cuda.py), the kernel benchmark on cuda, bench/results/gpu.json and a
# markdown summary (scripts/gpu_check.py; logs in build/gpu-check/). Without a GPU or nvcc it prints the
# plan and why, and exits 2. .venv/bin/python where there is one, else python3 (PY=... to choose);
# GPU_CHECK_ARGS="--list" prints the plan, "--only tests" runs one step.
GPU_CHECK_ARGS ?=
gpu-check: PY = $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
gpu-check:
	NVCC="$(NVCC)" $(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

bench-kernels: install
	$(PY) bench/kernels.py

# Accuracy on digits: BSP vs OSP (0.25 and auto), 3 seeds, 2 ranks under horovodrun.
bench-accuracy: install
	$(PY) bench/accuracy.py

# Time to accuracy with one rank 1x, 2x and 4x slower: HSP against BSP, OSP and DDP, 3 seeds, 2 ranks
# under torchrun (about 10 minutes; BENCH_ARGS="--batch-size 8 --channels 128 --epochs 10" for the
# small-micro-batch table of README, about 20).
bench-stragglers: install
	$(PY) bench/stragglers.py $(BENCH_ARGS)

# A straggler and a slow link at once (needs root): HSP composed with OSP(auto) and DSync(2) against HSP alone,
# OSP(auto) alone, osp BSP and DDP, 2 ranks behind 1 Gbit/s, the last rank 2x and 4x slower, then balanced; and the
# time to accuracy on digits at 2x, 3 seeds (about 25 minutes).
bench-stragglers-net: install
	$(PY) bench/train_throughput.py --models mlp --ranks 2 --bandwidths 1gbit --stragglers 2,4 --contenders stragglers \
	    --steps 10 --warmup 12 --repeats 2 --no-digits --json bench/out/throughput_stragglers_1gbit_r2.json
	$(PY) bench/train_throughput.py --models mlp --ranks 2 --bandwidths 1gbit --stragglers 1 --contenders stragglers \
	    --steps 10 --warmup 12 --repeats 1 --no-digits --json bench/out/throughput_stragglers_1gbit_r2_balanced.json
	$(PY) bench/time_to_accuracy.py --contenders stragglers --straggler 2 --run-timeout 300 \
	    --json bench/out/time_to_accuracy_stragglers.json

# Lightning behind 1 Gbit/s (needs root): Trainer(strategy=OSPStrategy(OSP(auto))) against strategy="ddp", beside the
# plain loops and the halves of the perfect-overlap bound, 2 ranks, MLP 8.4M, batch 512, 2 repeats (about 5 minutes).
bench-lightning: install
	$(PY) bench/lightning_throughput.py --rate 1gbit --repeats 2 --json bench/results/lightning_throughput_1gbit_r2.json

# osp.plan against measurement (needs root): for the MLP, ResNet-18 and GPT in turn, profiles and the throughput
# bench on 2 and 4 ranks at 1 and 10 Gbit/s and unshaped (each mode once); then a second pass of the bench on the
# same profiles, each run pooling the ones before (about 90 minutes on 2 cores); the last writes the comparison of
# every configuration, bench/results/plan_validation.*
PLAN_OUT := bench/out/plan
bench-plan: install
	$(PY) bench/plan_validation.py --models mlp --repeats 1 --out $(PLAN_OUT)_mlp $(BENCH_ARGS)
	$(PY) bench/plan_validation.py --models resnet18 --repeats 1 --also $(PLAN_OUT)_mlp.json --out $(PLAN_OUT)_resnet18 $(BENCH_ARGS)
	$(PY) bench/plan_validation.py --models gpt --repeats 1 --also $(PLAN_OUT)_resnet18.json --out $(PLAN_OUT)_gpt $(BENCH_ARGS)
	$(PY) bench/plan_validation.py --models mlp --repeats 1 --profiles $(PLAN_OUT)_gpt.json --also $(PLAN_OUT)_gpt.json --out $(PLAN_OUT)_mlp2 $(BENCH_ARGS)
	$(PY) bench/plan_validation.py --models resnet18 --repeats 1 --profiles $(PLAN_OUT)_mlp2.json --also $(PLAN_OUT)_mlp2.json --out $(PLAN_OUT)_r18_2 $(BENCH_ARGS)
	$(PY) bench/plan_validation.py --models gpt --repeats 1 --profiles $(PLAN_OUT)_r18_2.json --also $(PLAN_OUT)_r18_2.json --out bench/results/plan_validation $(BENCH_ARGS)

# Faults survived: SIGKILLed ranks under Horovod Elastic (3 ranks, 2 kills) and under torchrun restarts
# (1 kill), each against the same job without faults, 3 seeds (3-4 minutes).
bench-faults: install
	$(PY) bench/faults.py

# Time to accuracy behind emulated 1 Gbit/s links (needs root): a 4.3M-parameter digits MLP on 2 ranks, BSP,
# DDP, Horovod's optimizer and OSP auto, 3 seeds (about 6 minutes on 2 cores; "--model cnn" for the CNN).
# BENCH_ARGS as for bench, e.g. "--seeds 0 --epochs 2 --contenders bsp,osp-auto" for a smoke run.
bench-tta: install
	$(PY) bench/time_to_accuracy.py $(BENCH_ARGS)

# Compression (needs root): the throughput contenders with and without fp16 (DDP's hooks, PowerSGD, Horovod's
# fp16, osp BSP / OSP(auto) / DSync) on 2 and 4 ranks behind 1 and 10 Gbit/s links, MLP / ResNet-18 / GPT, a
# table each (the median of 2 runs on 2 ranks, one run on 4); then time to accuracy on digits, 3 seeds,
# against DDP's fp16 hook (about an hour and forty minutes on 2 cores).
bench-compression: install
	for r in 2 4; do for b in 1gbit 10gbit; do $(PY) bench/train_throughput.py --models mlp,resnet18,gpt \
	    --ranks $$r --bandwidths $$b --contenders compression --steps 10 --warmup 12 --repeats $$((r == 2 ? 2 : 1)) --no-digits \
	    --json bench/out/throughput_compression_$${b}_r$$r.json || exit 1; done; done
	$(PY) bench/time_to_accuracy.py --contenders compression --run-timeout 150 \
	    --json bench/out/time_to_accuracy_compression.json

# Throughput under an emulated network bottleneck (needs root: network namespaces and tc).
# BENCH_ARGS=--quick for a few minutes on 2 cores.
BENCH_ARGS ?=
bench: install
	$(PY) bench/train_throughput.py $(BENCH_ARGS)

# Quick start. As root (network namespaces and tc): BSP then OSP auto on 2 ranks behind a shaped 1 Gbit/s link
# (a 4.3M-parameter digits MLP, or DEMO_ARGS="--model cnn"), then a side-by-side table. Elsewhere it says so first
# and emulates the link in user space instead (osp.train --link 1gbit: each collective takes at least its ring
# allreduce's time at that rate, one at a time; not a real network): osp's BSP, OSP auto, DSync(2), Horovod's
# optimizer and DDP, 3 runs each taking turns, their median samples/s with its range and their ratios to BSP and
# DDP with their spread (about 4 minutes on 2 cores). DEMO_ARGS="--emulate" for the emulated one anywhere,
# "--repeats 1" for a quicker one, "--latency 200us" to add latency, "--loopback" for plain loopback.
DEMO_ARGS ?=
demo: install
	$(PY) scripts/demo.py $(DEMO_ARGS)

# The slow-rank warning on real launches (bench/slow_rank_warning.py, about 5 minutes; run it alone): 20 balanced
# 2-rank osp.train runs under torchrun, horovodrun --gloo and mpirun must warn 0 times, 12 with rank 1 2x slower
# must name rank 1 every time.
check-slow-rank: install
	$(PY) bench/slow_rank_warning.py $(BENCH_ARGS)

clean:
	rm -rf build python/osp/*.so python/*.egg-info
