# flowrl — the two commands of the quickstart, plus helpers.
#   make demo   set up, then train the default job on embedded defaults (~5 min on 2 CPU cores)
#   make test   set up, then run the test suite
VENV   ?= .venv
PYTHON ?= python3
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.flowrl-installed
# The thin Tinker client (tests/test_tinker_cookbook.py): the SDK and tinker-cookbook only, in a
# venv of their own (the cookbook needs an older transformers than flowrl's).
CLIENT_VENV  ?= .venv-client
CLIENT_REQS   = tests/tinker_client_requirements.txt
CLIENT_STAMP  = $(CLIENT_VENV)/.flowrl-installed

.PHONY: setup demo test lint bench bench-trl clean

# The venv (below), then the UI tests' browser (tests/test_ui.py): Debian's chromium, driven by
# Playwright (whose own browser download is not reachable everywhere). Without apt (or root),
# set-up goes on and those tests skip, saying what to install.
setup: $(STAMP) $(CLIENT_STAMP)
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "make setup: no chromium installed (apt-get install chromium): tests/test_ui.py will skip"

# torch first, pinned to the local CPU wheel: any other torch spec pulls GBs of CUDA packages.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $@

# Rebuilt from scratch (--clear) when its requirements change; torch first, as above.
$(CLIENT_STAMP): $(CLIENT_REQS)
	$(PYTHON) -m venv --clear $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/python -m pip install -q torch==2.13.0
	$(CLIENT_VENV)/bin/python -m pip install -q -r $(CLIENT_REQS)
	touch $@

demo: setup
	$(BIN)/flowrl train configs/arithmetic.yaml

# Bytecode of flowrl's own modules first: with PYTHONDONTWRITEBYTECODE set, every job, flow-run
# and Ray worker process of the suite would otherwise compile them again (~0.3 s of CPU each).
test: setup
	$(BIN)/python -m compileall -q flowrl flows tasks backends infra environments agent_loop
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/step_time.py --out docs/benchmarks/step_time.md

bench-trl: setup
	$(BIN)/python benchmarks/trl_compare.py --trl-threads 1 2 --flowrl-set resources.trainer_threads=2 --out docs/benchmarks.md

clean:
	rm -rf .flowrl
