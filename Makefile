# Two commands do all the set-up on a fresh machine:
#   make run    -> the main job (examples/run_tknp_decode.py; pass flags with ARGS="...")
#   make test   -> the test suite
# Both create .venv on first use. A torch that the system Python already imports is
# reused (GPU clusters ship their own); otherwise torch==2.13.0 (CPU build) is installed.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
PYTEST_ARGS ?=
# Test files run on this many processes (pytest-xdist), each file's tests in one of them so
# that a file's shared fixtures are built once, the longest files first (tests/conftest.py).
# Many tests wait on subprocesses and sockets, so two processes keep a 2-core machine busy
# where one leaves it idle a third of the time.
TEST_WORKERS ?= 2

.PHONY: run serve test venv clean

$(VENV)/.installed: setup.py tools/bootstrap_env.sh
	bash tools/bootstrap_env.sh $(VENV)
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) examples/run_tknp_decode.py $(ARGS)

serve: venv
	$(PY) examples/serve_tknp.py $(ARGS)

# Bytecode is written as the tests first import a module (tools/bootstrap_env.sh compiled
# what the library imports), even where PYTHONDONTWRITEBYTECODE is set: each of the suite's
# hundreds of processes would otherwise compile it again.
test: venv
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV)
