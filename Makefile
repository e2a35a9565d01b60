# make demo | make test | make test-training | make bench | make fuzz — each sets up its own .venv on a fresh machine;
# make test-mcore012 (the Megatron tests, training job included, on megatron-core 0.12.1) its own .venv-mcore012.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# torch_npu, where installed, hooks `import torch` and dies without Ascend's CANN runtime.
export TORCH_DEVICE_BACKEND_AUTOLOAD := 0

# A second venv on the users' seed line of megatron-core, 0.12.1; `make test-mcore012` runs the Megatron tests on it.
VENV012  := .venv-mcore012
PY012    := $(VENV012)/bin/python
STAMP012 := $(VENV012)/.installed

.PHONY: demo test test-training test-mcore012 fuzz bench venv venv-mcore012 clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# The CPU build of torch first, pinned, so no dependency pulls a CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,bench]'
	touch $@

venv-mcore012: $(STAMP012)

# Built as .venv is (CPU torch first, then the project), then megatron-core 0.12.1 over the 0.16.1 the extras pin.
$(STAMP012): pyproject.toml
	$(PYTHON) -m venv $(VENV012)
	$(VENV012)/bin/pip install -q --upgrade pip
	$(VENV012)/bin/pip install -q torch==2.13.0
	$(PY012) -c "import torch; print(torch.__version__)" > $(VENV012)/.torch-version
	$(VENV012)/bin/pip install -q -e '.[test]'
	$(VENV012)/bin/pip install -q megatron-core==0.12.1
	# megatron-core 0.12.1 and its dependencies must leave the torch build of the first step in place.
	$(PY012) -c "import sys, torch; from importlib.metadata import version as v; kept = open(sys.argv[1]).read().strip(); \
		assert torch.__version__ == kept, f'torch {kept} was replaced by {torch.__version__}'; \
		assert v('megatron-core') == '0.12.1', v('megatron-core')" $(VENV012)/.torch-version
	touch $@

# The seed's Megatron-LM job scaled down: 2 processes, every layer compiled (megatron_glue/demo.py).
demo: $(STAMP)
	$(PY) -m megatron_glue.demo

# Two pytest-xdist workers (this machine's two cores), each test module kept on one worker (its module-scoped
# fixtures, e.g. a TP=2 gloo run, are made once); the longest modules first (tests/xdist_order.py).
XDIST := -n 2 --dist loadscope
# One torch thread a worker for the in-process targets: two workers of two threads each on two cores preempt each other
# (the job's ranks already run with one, tests/megatron_glue/pretrain_runs.py).
ONE_THREAD := OMP_NUM_THREADS=1

# Everything in one process (or a second process that is not a gloo group): ops, passes, lowering, the compiled
# Megatron models, conversion, the job's argument checks.
test: $(STAMP)
	$(ONE_THREAD) $(PY) -m pytest -q --durations=25 $(XDIST) -m "not fuzz and not training and not gloo"

# The multi-process tests over gloo: the training job at every parallel layout, checkpoints, mixed precision, the
# seed script; and the other gloo groups (TP=2 capture, the TP=2 loss, overlap and MC2 over gloo, rank failures).
test-training: $(STAMP)
	$(PY) -m pytest -q --durations=25 $(XDIST) -m "(training or gloo) and not fuzz"

# The Megatron tests on megatron-core 0.12.1, limited to what can differ on that line: the Megatron folders' in-process
# tests (less what is marked any_megatron_line: the converter's own checks, the same on every line), of the
# multi-process training tests those marked megatron_lines (the code paths megatron_glue/training/versions.py switches:
# interleaved pipeline stages, the distributed optimizer's checkpoint), and of tests/passes those that build on
# megatron-core (megatron_glue.capture.testing's --megatron-only); one session, so the workers start once.
test-mcore012: $(STAMP012)
	$(ONE_THREAD) $(PY012) -m pytest -q --durations=25 $(XDIST) -m "not fuzz and not any_megatron_line and (not training or megatron_lines)" \
		-p megatron_glue.capture.testing --megatron-only=tests/passes tests/megatron_glue tests/lowering/test_megatron.py tests/passes

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m fuzz

# Every file in bench/results/ that the README or docs/ cite, regenerated in one run (about 80 minutes on a 2-core machine; each
# bench's own docstring says what it measures). Those that run MindSpeed-LLM's example scripts read its git repository:
# `make bench MINDSPEED_LLM=/path/to/MindSpeed-LLM.git`; without it they are not run (make bench prints their
# commands) and their six files stay as they were last written.
BENCHES := bench bench.overlap bench.memory bench.convert_memory bench.memory_fit bench.recompute \
	bench.reference_kernels bench.fused_loss bench.long_context_memory "bench.hf_fusions --before bench/results/hf_fusions_before.json" bench.step_time \
	"bench.compile_time" "bench.compile_time --ordering" "bench.compile_time --phases" bench.pattern_cache \
	bench.moe_step bench.moe_parallel
SCRIPT_BENCHES := bench.mindspeed_census "bench.mindspeed_scripts --only dense" "bench.mindspeed_scripts --only moe" \
	bench.sft_scripts bench.gdn_scripts bench.cp_scripts
MINDSPEED_LLM ?=

bench: $(STAMP)
	@set -e; for b in $(BENCHES); do echo "== make bench: python -m $$b"; $(PY) -m $$b; done
	@set -e; if [ -z "$(MINDSPEED_LLM)" ]; then \
		echo "== make bench: MindSpeed-LLM's scripts not run (give MINDSPEED_LLM=<a MindSpeed-LLM git directory>):"; \
		for b in $(SCRIPT_BENCHES); do echo "   python -m $$b --repo <MindSpeed-LLM git directory>"; done; \
	else for b in $(SCRIPT_BENCHES); do echo "== make bench: python -m $$b"; $(PY) -m $$b --repo "$(MINDSPEED_LLM)"; done; fi

clean:
	rm -rf $(VENV) $(VENV012) npu_compile_dump .pytest_cache .hypothesis
