# Two commands on a fresh machine: `make demo` and `make test`. Both set up their environments first (idempotent).
# .venv holds skyrl 0.4 (the current SkyRL, what users install): the demo and the host-independent suite run there.
VENV ?= .venv
PY := $(VENV)/bin/python
# skyrl-train 0.3.1 in its own environment (scripts/setup.sh skyrl-train): its own tests, tests/host03.
VENV_SKYRL_TRAIN ?= .venv-skyrl-train
PY_SKYRL_TRAIN := $(VENV_SKYRL_TRAIN)/bin/python
export PYTHONUNBUFFERED := 1

.PHONY: setup setup-skyrl-train demo demo-skyrl-train test test-skyrl-train test-fast lint clean

setup:
	@bash scripts/setup.sh

setup-skyrl-train:
	@SKYRL_MEGATRON_VENV=$(VENV_SKYRL_TRAIN) bash scripts/setup.sh skyrl-train

# The main job on skyrl 0.4; `make demo-skyrl-train` runs it on skyrl-train 0.3.1.
demo: setup
	$(PY) -m skyrl_megatron.demo

demo-skyrl-train: setup-skyrl-train
	$(PY_SKYRL_TRAIN) -m skyrl_megatron.demo --out outputs/demo-skyrl-train

# Both host legs, side by side (scripts/test.sh): skyrl 0.4 (.venv: tests/ but tests/host03, which
# tests/conftest.py leaves out there) and skyrl-train 0.3.1 (.venv-skyrl-train: tests/host03, its own tests and the
# twins of the end-to-end runs). A leg that collects nothing fails.
test: setup setup-skyrl-train
	@VENV=$(VENV) VENV_SKYRL_TRAIN=$(VENV_SKYRL_TRAIN) bash scripts/test.sh

test-skyrl-train: setup-skyrl-train
	$(PY_SKYRL_TRAIN) -m pytest -q -p no:cacheprovider tests/host03

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

clean:
	rm -rf $(VENV) $(VENV_SKYRL_TRAIN) build dist *.egg-info
