#!/usr/bin/env bash
# The whole suite on both hosts, one leg after the other (`make test` sets up both environments first):
#   skyrl 0.4         .venv               tests/ but tests/host03 (tests/conftest.py leaves it out there)
#   skyrl-train 0.3.1 .venv-skyrl-train   tests/host03
# One after the other, not side by side: the hosts pick their process groups' ports by binding port 0 and
# closing it before the group listens there, and the other leg's gloo groups, binding ports all the while,
# took one such port (EADDRINUSE) in a side-by-side run. The skyrl 0.4 leg prints as it runs; the 0.3.1
# leg's output is kept in outputs/test-logs/skyrl-train.log and printed after it. pytest's exit 5 (nothing
# collected) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
VENV_SKYRL_TRAIN=${VENV_SKYRL_TRAIN:-.venv-skyrl-train}
LOGS=outputs/test-logs
mkdir -p "$LOGS"
PYTEST=(-m pytest -q -p no:cacheprovider --durations=15)

"$VENV/bin/python" "${PYTEST[@]}" tests 2>&1 | tee "$LOGS/skyrl.log"
rc04=${PIPESTATUS[0]}
"$VENV_SKYRL_TRAIN/bin/python" "${PYTEST[@]}" tests/host03 > "$LOGS/skyrl-train.log" 2>&1
rc03=$?

echo
echo "==================== skyrl-train 0.3.1 leg (tests/host03) ===================="
cat "$LOGS/skyrl-train.log"
echo
status() {  # leg name, exit code, log name under $LOGS
  case "$2" in
    0) echo "make test: $1 leg passed" ;;
    5) echo "make test: $1 leg collected no tests" ;;
    *) echo "make test: $1 leg failed (pytest exit $2)"; grep -E "^(FAILED|ERROR) " "$LOGS/$3.log" ;;
  esac
}
status "skyrl 0.4" "$rc04" skyrl
status "skyrl-train 0.3.1" "$rc03" skyrl-train
[[ "$rc04" -eq 0 && "$rc03" -eq 0 ]]
