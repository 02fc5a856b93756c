# The two commands of the README: `make up` starts the system, `make test` runs the tests.
VENV ?= .venv
# Test modules run on this many workers (pytest-xdist); a module and its fixtures stay on one.
TEST_WORKERS ?= 2

.PHONY: install up test lint bench

$(VENV)/.installed: pyproject.toml setup.py constraints.txt cli/pyproject.toml \
		tests/pyproject.toml bench/pyproject.toml \
		$(wildcard services/*/pyproject.toml) $(wildcard proto/openbook/v1/*.proto)
	scripts/install.sh

install: $(VENV)/.installed

up: $(VENV)/.installed
	$(VENV)/bin/openbook up

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not alone"
	$(VENV)/bin/python -m pytest -m alone

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
