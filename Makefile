# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup demo test test-fast lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m skyrl_megatron.demo

# pytest exits 5 when it collected nothing: that is a failure here, not a pass.
test: setup
	@$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; exit $$rc

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

clean:
	rm -rf $(VENV) build dist *.egg-info
