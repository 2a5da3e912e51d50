#!/usr/bin/env bash
# Idempotent set-up of a virtual environment (Python 3.12) in the order that works on a CPU-only box
# (docs/install.md explains each step). A second run with unchanged inputs takes seconds.
#
#   scripts/setup.sh               .venv              with the host skyrl 0.4 (requirements/host04.txt)
#   scripts/setup.sh skyrl-train   .venv-skyrl-train  with the host skyrl-train 0.3.1 (requirements/host.txt)
# SKYRL_MEGATRON_VENV=DIR puts the environment in DIR instead.
set -euo pipefail
cd "$(dirname "$0")/.."

HOST_LEG=${1:-skyrl}
case "$HOST_LEG" in
  skyrl)       DEFAULT_VENV=.venv;             HOST_REQUIREMENTS=requirements/host04.txt; OTHER_HOST=skyrl-train ;;
  skyrl-train) DEFAULT_VENV=.venv-skyrl-train; HOST_REQUIREMENTS=requirements/host.txt;   OTHER_HOST=skyrl ;;
  *) echo "setup: unknown host '$HOST_LEG'; use skyrl (0.4, the default) or skyrl-train (0.3.1)" >&2; exit 2 ;;
esac
VENV=${SKYRL_MEGATRON_VENV:-$DEFAULT_VENV}
STAMP="$VENV/.skyrl-megatron-setup"

find_python312() {
  if [[ -n "${PYTHON312:-}" ]]; then echo "$PYTHON312"; return; fi
  if command -v pyenv >/dev/null 2>&1; then
    local root; root="$(pyenv root)"
    for v in 3.12.1 $(ls "$root/versions" 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -V -r); do
      if [[ -x "$root/versions/$v/bin/python3.12" ]]; then echo "$root/versions/$v/bin/python3.12"; return; fi
    done
  fi
  if command -v python3.12 >/dev/null 2>&1; then command -v python3.12; return; fi
  echo "setup: no Python 3.12 found (tried \$PYTHON312, pyenv, python3.12 on PATH); install Python 3.12" >&2
  exit 1
}

inputs_hash() { cat scripts/setup.sh requirements/*.txt pyproject.toml | sha256sum | cut -c1-16; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(inputs_hash)" && -x "$VENV/bin/python" ]]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

# An environment holding the other host (.venv held skyrl-train 0.3.1 before skyrl 0.4 became the
# default) is built again from scratch: installing over it would leave both hosts and mixed pins.
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$OTHER_HOST" 2>/dev/null; then
  echo "setup: $VENV holds $OTHER_HOST, the other host; building it again"
  rm -rf "$VENV"
fi

PY=$(find_python312)
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "setup: creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
# -q: one progress line per step instead of pip's log; pip still prints its warnings and, on a failure, its
# error (set -e then stops here with pip's exit status).
PIP_INSTALL=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# A machine's pip configuration may name local package indexes (file://...) that lack most projects; pip then
# warns once per project and index. Those lines say nothing about this install and are left out; everything
# else pip prints passes through, and its exit status stays the step's.
pip_install() {
  "${PIP_INSTALL[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored: it is neither a file nor a directory\.$" || true; }
}
PIP=(pip_install)
step() { echo "setup: $*"; }
"${PIP[@]}" --upgrade pip

step "1/5 torch and build helpers (requirements/base.txt)"
# flash-attn's setup.py imports torch.
"${PIP[@]}" -r requirements/base.txt
step "2/5 flash-attn as pure Python (requirements/flash_attn.txt)"
# no CUDA compile, no prebuilt-binary download (the host hard-depends on it).
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
  "${PIP[@]}" --no-build-isolation --no-deps -r requirements/flash_attn.txt
step "3/5 the host, megatron-core and the rest ($HOST_REQUIREMENTS)"
"${PIP[@]}" -r "$HOST_REQUIREMENTS"
step "4/5 Megatron-Bridge without its metadata dependencies (requirements/bridge.txt)"
# They pin transformers/hydra-core/wandb versions and CUDA-only packages; docs/install.md lists what was
# checked instead.
"${PIP[@]}" --no-deps -r requirements/bridge.txt
step "5/5 skyrl-megatron, editable"
# setuptools says "Editable installation." for every editable install whose packages are mapped from
# other folders (our config/ ships as skyrl_megatron.conf): a notice, not a problem, so that one message is
# filtered out of the build backend's warnings.
PYTHONWARNINGS="ignore:Editable installation." "${PIP[@]}" --no-deps -e .

inputs_hash > "$STAMP"
echo "setup: done ($VENV)"
