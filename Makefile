# Quick start: `make demo` then `make test`. Everything lives in .venv; nothing is installed by hand.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
MODEL  ?= smollm2-135m

.PHONY: install install-dev browser demo test test-fast bench clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build on this machine's disk, never a multi-GB CUDA download
	$(PIP) install -q torch==2.13.0
	touch $@

$(VENV)/.installed: $(VENV)/.base pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The page's browser test (tests/test_web_browser.py) drives Debian's chromium through Playwright: its
# own browser download cannot work offline. Installed where missing and possible (root, apt-get);
# otherwise the test is skipped and says why.
browser:
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "chromium could not be installed: the browser test will be skipped"

demo: install
	$(VENV)/bin/kvlab pull $(MODEL)
	$(VENV)/bin/kvlab run $(MODEL) --chat "What is the capital of France? Answer in one sentence."

# KVLAB_KERNELS=require: a C kernel that does not build fails the suite in one line instead of skipping its tests
test: install-dev browser
	KVLAB_KERNELS=require $(PY) -m pytest -q

test-fast: install-dev browser
	KVLAB_KERNELS=require $(PY) -m pytest -q -m "not real"

# the speed figures in the README: kvlab vs transformers, then the serving engine (minutes, not a test)
bench: install-dev
	$(VENV)/bin/kvlab pull $(MODEL)
	$(PY) benchmarks/bench_core.py --model $(MODEL) --dtype float32 --repeat 5
	$(PY) benchmarks/bench_serve.py --model $(MODEL) --threads 2 --repeat 3

clean:
	rm -rf $(VENV) build *.egg-info
