# A thin helper over the `ep-harness` command; CI calls these targets and nothing else.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SUITE ?= smoke
NIGHTLY_SUITE ?= nightly
SUMMARY_MD ?=
JUNIT_XML ?=
GPUS ?=
PYTEST_WORKERS ?= 3
# Reuse the system torch where one is installed (the GPU images); elsewhere install the CPU
# build, which `pip install torch==2.13.0` takes from this machine's disk.
SYSTEM_TORCH := $(shell $(PYTHON) -c "import torch" >/dev/null 2>&1 && echo yes)
EMULATE_HOSTS ?=
EMULATE ?=
# EMULATE=hosts (or EMULATE_HOSTS=1): GPUS=N NCCL ranks share the visible GPU(s), one emulated host per rank;
# EMULATE=single-node: they form one NCCL node (NCCL >= 2.30, docs/gpu.md).
GPU_FLAG := $(if $(GPUS),--gpus $(GPUS),) $(if $(filter 1 yes true,$(EMULATE_HOSTS)),--emulate hosts,) \
	$(if $(EMULATE),--emulate $(EMULATE),)
# Several nodes: NNODES=2 NPROC_PER_NODE=8 RDZV=head:29400 NODE_RANK=0 (1 on the other node), or LAUNCHER=slurm.
NNODES ?=
NPROC_PER_NODE ?=
RDZV ?=
NODE_RANK ?=
LAUNCHER ?=
NODE_FLAG := $(if $(NNODES),--nnodes $(NNODES),) $(if $(NPROC_PER_NODE),--nproc-per-node $(NPROC_PER_NODE),) \
	$(if $(RDZV),--rdzv-endpoint $(RDZV),) $(if $(NODE_RANK),--node-rank $(NODE_RANK),) $(if $(LAUNCHER),--launcher $(LAUNCHER),)

.PHONY: install verify test bench bench-gpu report nightly baseline deepep-ready screenshot clean

install: $(VENV)/.installed

# The first set-up takes a minute or two: each step says what it does before it starts, and
# pip's own lines (without -q) show it working.
$(VENV)/.installed: pyproject.toml setup.py
	@echo "# [1/3] virtual environment $(VENV)$(if $(SYSTEM_TORCH), (with the system torch),)"
	@$(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages,) $(VENV)
	@$(PY) -c "import torch" >/dev/null 2>&1 && echo "# [2/3] torch: $$($(PY) -c 'import torch; print(torch.__version__)') already there" || \
		{ echo "# [2/3] torch 2.13.0, the CPU build where this machine's package index has it (about 30 s; docs/gpu.md for GPUs)"; \
		  $(PY) -m pip install --progress-bar on torch==2.13.0; }
	@echo "# [3/3] ep-harness (editable) and the test tools: pytest, hypothesis, triton, ..."
	@$(PY) -m pip install --progress-bar on --no-build-isolation -e '.[test]'
	@touch $@
	@echo "# set-up done: $(VENV)"

# The command starts with the hash seed its ranks are pinned to (unless the shell sets one), so
# that it forks their torchrun agent instead of starting a new interpreter (harness/launch/forks.py).
verify: install
	PYTHONHASHSEED=$${PYTHONHASHSEED-0} $(VENV)/bin/ep-harness verify --suite $(SUITE) $(GPU_FLAG) $(NODE_FLAG)

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: every pytest process (workers,
# and the sessions some tests start) would otherwise compile and assert-rewrite the same ~180
# modules of the harness, the tests and the pytest plugins' packages again (1.4 s of CPU each).
test: install
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal tests

bench: install
	$(PY) -m ep_harness.cost.bench

# On a GPU: GEMM and quantization cost at engine shapes, with each GEMM's batch-invariance verdict.
bench-gpu: install
	$(PY) -m ep_harness.cost.bench_gemm_cost --out reports/out/cost

nightly: install
	PYTHONHASHSEED=$${PYTHONHASHSEED-0} $(VENV)/bin/ep-harness nightly --suite $(NIGHTLY_SUITE) $(GPU_FLAG) \
		$(if $(SUMMARY_MD),--summary-md $(SUMMARY_MD),) $(if $(JUNIT_XML),--junit-xml $(JUNIT_XML),)

# For the nightly workflow: prints skip=false where DeepEP imports and EP_HARNESS_DEEPEP_VERSION
# names it, else skip=true, and the reason on stderr and in the job's summary (a night without
# DeepEP must not look like a night DeepEP passed).
DEEPEP_MISSING := h200-deepep not run: DeepEP does not import here or EP_HARNESS_DEEPEP_VERSION is unset; build DeepEP from source (docs/gpu.md), put its build directory in the repository variable DEEPEP_BUILD_DIR and name it in EP_HARNESS_DEEPEP_VERSION
deepep-ready: install
	@if $(PY) -c "import deep_ep" >/dev/null 2>&1 && [ -n "$$EP_HARNESS_DEEPEP_VERSION" ]; then echo skip=false; \
	else echo "::warning::$(DEEPEP_MISSING)" >&2; [ -z "$$GITHUB_STEP_SUMMARY" ] || echo "$(DEEPEP_MISSING)" >> "$$GITHUB_STEP_SUMMARY"; \
	echo skip=true; fi

baseline: install
	$(VENV)/bin/ep-harness baseline update reports/out/latest

screenshot: install
	$(PY) docs/screenshot/take.py docs/report.png

report: install
	$(VENV)/bin/ep-harness report reports/out/latest

clean:
	rm -rf reports/out
