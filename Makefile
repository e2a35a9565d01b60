# make demo | make test | make bench | make fuzz — each sets up its own .venv on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch_npu, where installed, hooks `import torch` and dies without Ascend's CANN runtime.
export TORCH_DEVICE_BACKEND_AUTOLOAD := 0

.PHONY: demo test fuzz bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# The CPU build of torch first, pinned, so no dependency pulls a CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

demo: $(STAMP)
	$(PY) -m npu_compile demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not fuzz"

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m fuzz

bench: $(STAMP)
	$(PY) -m bench
	$(PY) -m bench.overlap
	$(PY) -m bench.memory

clean:
	rm -rf $(VENV) npu_compile_dump .pytest_cache .hypothesis
