# Quick start: `make demo` and `make test`. Both set everything up from a fresh
# clone (Debian + Python 3.11) and are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test install sysdeps clean

# Debian packages the tests need: a real redis-server to benchmark against.
sysdeps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (apt-get)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a CPU wheel; an unpinned torch would pull a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo

test: $(STAMP) sysdeps
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
