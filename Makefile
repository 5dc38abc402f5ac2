# The two commands of README.md: `make demo` and `make test`. Both build .venv first:
# torch==2.13.0 before the project, because any other torch spec pulls CUDA packages.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test unit bench venv clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[torch,test]'
	touch $@

demo: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" bash examples/demo.sh

test: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS) tests

# The unit tests alone (tests/README.md): under a minute, for the edit-test loop.
unit: venv
	$(PY) -m pytest -m unit -q -p no:cacheprovider $(PYTEST_ARGS) tests

# Every benchmark at this commit, one after the other, into BENCHMARKS.md (~40 minutes; run it
# on a quiet machine: benchmarks/README.md).
bench: venv
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) benchmarks/report.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
