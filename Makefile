# kernellab: the README's two commands are `make up` (the local stack with the embedded model) and `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/install-python-deps.sh 2>/dev/null | sha1sum | cut -c1-12)

.PHONY: install up generate test test-unit test-integration lint typecheck format bench-cpu stress gpu clean compose-smoke

$(STAMP): pyproject.toml scripts/install-python-deps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	VENV=$(VENV) bash scripts/install-python-deps.sh
	@touch $(STAMP)

install: $(STAMP)

up: install  ## gateway + worker + Redis on 127.0.0.1 with the embedded SmolLM2-135M
	$(BIN)/kernellab up

generate: install
	$(BIN)/kernellab generate smollm2-135m "What is the capital of France?"

# The unit tests run in TEST_WORKERS processes (pytest-xdist, a module's tests kept together), each with one
# intra-op thread: most of their time is the Triton interpreter's single-threaded Python, and a worker's torch
# threads would otherwise contend with the other worker's (on the 2-core CI machine: 953 s serial; in two
# workers 951 s at two threads each, 515 s at one thread each with the sm_90 compile cache warm, 606 s with it
# cold, as in CI). The integration tests start real processes and some time them, so they run alone afterwards.
TEST_WORKERS ?= auto
UNIT_TESTS = OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	--durations=15 tests/unit
INTEGRATION_TESTS = TRITON_INTERPRET=1 $(BIN)/python -m pytest -q --durations=15 tests/integration

test: install  ## everything CI runs: unit (CPU, Triton interpreter) + integration (real Redis, real processes)
	bash scripts/install-system-deps.sh
	$(UNIT_TESTS)
	$(INTEGRATION_TESTS)

test-unit: install
	$(UNIT_TESTS)

test-integration: install
	bash scripts/install-system-deps.sh
	$(INTEGRATION_TESTS)

lint: install  ## what CI checks before the tests: lint rules and formatting (ruff format, line length 120), types
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf .import-check && $(BIN)/pip install -q --no-deps --no-build-isolation --target .import-check . \
		&& cd /tmp && PYTHONPATH=$(CURDIR)/.import-check $(abspath $(BIN))/lint-imports $(CURDIR)/pyproject.toml; \
		rc=$$?; rm -rf $(CURDIR)/.import-check; exit $$rc
	VENV=$(VENV) bash scripts/typecheck.sh

typecheck: install  ## mypy over runtime/ and services/ ([tool.mypy] in pyproject.toml; incremental in .mypy_cache)
	VENV=$(VENV) bash scripts/typecheck.sh

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench-cpu: install  ## the CPU offline benchmark artifact (issue figures); run on a quiet machine
	$(BIN)/kernellab bench offline --model smollm2-135m --dtype auto --dtype float32 --weight-quant none \
		--weight-quant int4 --peer hf --peer llama.cpp \
		--output results/bench_offline_cpu.json

stress: install  ## every fault scenario at full scale against a private local stack (~20 min on 2 cores)
	$(BIN)/kernellab stress --scenario all --requests 5000 --fault-requests 1000 --concurrency 32

compose-smoke: install  ## as root: build the images, run the compose cpu profile end to end, write results/compose_smoke.json
	$(BIN)/python scripts/compose_smoke.py $(SMOKE_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache .typecheck
