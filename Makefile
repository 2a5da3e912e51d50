# Two commands on a fresh machine: `make demo` and `make test`. Both set up their environments first (idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
# skyrl 0.4 (the current SkyRL, what `make demo` runs on) in its own environment (scripts/setup.sh
# skyrl04); .venv holds skyrl-train 0.3.1 and runs the host-independent suite.
VENV04 ?= .venv-skyrl04
PY04 := $(VENV04)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup setup-skyrl04 demo demo-skyrl-train test test-skyrl04 test-fast lint clean

setup:
	@bash scripts/setup.sh

setup-skyrl04:
	@SKYRL_MEGATRON_VENV=$(VENV04) bash scripts/setup.sh skyrl04

# The main job on the current SkyRL (skyrl 0.4); `make demo-skyrl-train` runs it on skyrl-train 0.3.1.
demo: setup-skyrl04
	$(PY04) -m skyrl_megatron.demo

demo-skyrl-train: setup
	$(PY) -m skyrl_megatron.demo --out outputs/demo-skyrl-train

# Both host legs: skyrl-train 0.3.1 (.venv, the whole suite) and skyrl 0.4 (.venv-skyrl04, tests/host04).
# pytest exits 5 when it collected nothing: that is a failure here, not a pass.
test: setup setup-skyrl04
	@$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; \
	  $(PY04) -m pytest -q -p no:cacheprovider tests/host04; rc04=$$?; \
	  if [ $$rc04 -eq 5 ]; then echo "make test: no skyrl 0.4 tests were collected" >&2; exit 1; fi; \
	  if [ $$rc -ne 0 ]; then exit $$rc; fi; exit $$rc04

test-skyrl04: setup-skyrl04
	$(PY04) -m pytest -q -p no:cacheprovider tests/host04

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

clean:
	rm -rf $(VENV) $(VENV04) build dist *.egg-info
