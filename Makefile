# agent_runs — `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install migrate test demo dashboard screenshots bench designs chaos lint docs sql clean

help: ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create the venv and install the package with test and dev extras

migrate: $(STAMP) ## apply migrations to DATABASE_URL
	@test -n "$(DATABASE_URL)" || { echo "make migrate: set DATABASE_URL" >&2; exit 2; }
	$(BIN)/agent-runs migrate --dsn "$(DATABASE_URL)"

test: $(STAMP) ## run the test suite against a throwaway PostgreSQL
	$(BIN)/pytest $(PYTEST_ARGS)

demo: $(STAMP) ## run workers on a scripted mix of runs (embedded PostgreSQL) and show the history
	$(BIN)/agent-runs demo

dashboard: $(STAMP) ## serve the web dashboard on an embedded PostgreSQL running the demo's workload
	$(BIN)/python -m dev.dashboard_demo $(DASHBOARD_ARGS)

screenshots: $(STAMP) ## regenerate docs/screenshots/*.png (the dashboard in Debian's chromium)
	$(BIN)/python -m dev.screenshots

bench: $(STAMP) ## measure the hot path against hand-written SQL and other queues (embedded PostgreSQL)
	$(BIN)/python -c 'import pgqueuer, procrastinate' 2>/dev/null \
		|| $(BIN)/pip install --quiet -e '.[dev,compare]'
	$(BIN)/python -m bench $(BENCH_ARGS)

designs: $(STAMP) ## what each schema design costs against the lean floor (embedded PostgreSQL, ~8 min)
	$(BIN)/python -m bench.designs $(DESIGNS_ARGS)

chaos: $(STAMP) ## fault-injection suite: kill workers, drop connections, restart PostgreSQL
	$(BIN)/python -m chaos $(CHAOS_ARGS)

lint: $(STAMP) ## ruff, mypy and the import rules (lint-imports)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

docs: $(STAMP) ## build the documentation site into site/ (mkdocs, warnings are errors)
	$(BIN)/python -c 'import mkdocs, material, mkdocstrings_handlers.python' 2>/dev/null \
		|| $(BIN)/pip install --quiet -e '.[dev,docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict $(DOCS_ARGS)

sql: $(STAMP) ## print sql/'s statements, fragments in place (SQL_ARGS="<name> ..." for some)
	@$(BIN)/python -c 'import sys; from agent_runs.sql import main; main(sys.argv[1:])' $(SQL_ARGS)

clean: ## remove the venv, caches and the built site
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site
