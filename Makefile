# The two set-up commands of the README: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
# pytest-xdist workers for `make test`: more than the cores, as the end-to-end tests also wait on their services
TEST_WORKERS ?= 4

.PHONY: install demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install  ## runs the quickstart on the embedded defaults: SQLite MLflow store (mlflow.db), CPU
	$(BIN)/fedpilot run pipelines/quickstart.yaml

lint: install
	$(BIN)/ruff check platform tests bench

test: lint
	$(BIN)/pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: install  ## fedpilot vs peers, one table (peers' venvs set up on first use); BENCH_ARGS="--no-peers", "--device cuda"
	$(BIN)/python bench/compare.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .fedpilot-cache mlruns mlflow.db
