# The two commands of README.md: `make demo` and `make test`. Both build .venv first:
# torch==2.13.0 before the project, because any other torch spec pulls CUDA packages.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
#: `make test` runs this many tests at a time (most end-to-end tests wait rather than compute).
TEST_JOBS ?= 5

.PHONY: demo test test-quick unit lint bench gpu-check venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[torch,test]'
	touch $@

demo: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

# The project's own modules compiled once, before the tests start their processes: where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines), every process that imports
# procckpt compiled its modules again, 0.15 processor seconds for a training's, in each of the
# suite's thousands of processes. (pip compiles what it installs; an editable install's
# source it does not.)
BYTECODE = $(PY) -m compileall -q -j 0 src tests examples benchmarks tools

test: venv lint
	$(BYTECODE)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -n $(TEST_JOBS) --dist loadgroup $(PYTEST_ARGS) tests

# One end-to-end test of each capability (tests/quick.txt), with the unit tests: a few
# minutes, for a contributor who changed one thing (tests/README.md).
test-quick: venv lint
	$(BYTECODE)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -m "unit or quick" -q -p no:cacheprovider -n 2 $(PYTEST_ARGS) tests

# The unit tests alone (tests/README.md): under a minute, for the edit-test loop.
unit: venv lint
	$(BYTECODE)
	$(PY) -m pytest -m unit -q -p no:cacheprovider $(PYTEST_ARGS) tests

# The style the code is written in (shared/STYLE.md): line length, imports, function size and
# complexity (ruff, pyproject.toml), and the package's types (mypy).
lint: venv
	$(VENV)/bin/ruff check src tests benchmarks tools examples
	$(VENV)/bin/mypy

# Every benchmark at this commit, one after the other, into BENCHMARKS.md (~40 minutes; run it
# on a quiet machine: benchmarks/README.md).
bench: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/report.py $(BENCH_ARGS)

# The first thing to run on a machine with a GPU (tools/gpu_check.py): the CUDA tests and the GPU
# checkpoint benchmark at 1 and 8 GiB, one table, in at most 6 minutes (GPU_ARGS=--quick: the
# tests and 1 GiB, 3; GPU_ARGS="--out DIR": the log and figures there). It uses the machine's
# own python (its torch with CUDA) and the source tree, never the CPU venv; without a GPU it
# is a dry run.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH="$(abspath src)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PY) tools/gpu_check.py $(GPU_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
