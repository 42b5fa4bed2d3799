# dspark — the two set-up commands: `make serve` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= dspark-target
PROMPT ?= def fibonacci(n):

.PHONY: install serve test lint bench data data-deps clean

$(BIN)/dspark: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/dspark

# Main job (for now): speculative generation with the n-gram drafter on the shipped target, then the same
# prompt without speculation; greedy outputs are identical, τ and tokens/s differ.
serve: $(BIN)/dspark
	$(BIN)/dspark generate --model $(MODEL) --method ngram --gamma 4 --max-tokens 96 --prompt '$(PROMPT)'
	$(BIN)/dspark generate --model $(MODEL) --method none --max-tokens 96 --prompt '$(PROMPT)'

test: data-deps $(BIN)/dspark
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(BIN)/dspark
	$(BIN)/ruff check .

bench: $(BIN)/dspark
	$(BIN)/python benchmarks/engine.py

# Debian's python3.11-doc holds the reST sources of the chat corpus.
data-deps:
	@test -d /usr/share/doc/python3.11/html/_sources || (apt-get update && apt-get install -y --no-install-recommends python3.11-doc)

data: data-deps $(BIN)/dspark
	$(BIN)/dspark data build

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
