#!/usr/bin/env bash
# Does our plugin change the host's own tests? Runs a SkyRL host's own CPU tests twice, once plain and once with
# skyrl_megatron.activate() called first (pytest_configure of a throwaway pytest plugin), and compares the
# outcome of every test (junit XML). Expected: no differences. Exits 1 if there are any.
#
# One-off check, not part of CI or `make test`: the hosts' tests are not in their registry packages, so they come
# from a snapshot of the public NovaSky-AI/SkyRL repository (a bare git dir).
#
# Usage: scripts/host_own_tests.sh HOST GIT_DIR PYTHON OUT_DIR [extra pytest args...]
#   HOST     skyrl-0.4 | skyrl-train-0.3.1: picks the commit, the folder run from, and the pytest arguments in
#            scripts/host_own_tests/HOST.args (the host's CPU suite as its CI runs it, minus the tests that need a
#            GPU, the internet, or modules the installed release no longer has; docs/results/host_own_tests_2026-11-26.md)
#   GIT_DIR  bare git dir of NovaSky-AI/SkyRL
#   PYTHON   python of a venv with that host and pytest-timeout installed (only the tests are exported: the host
#            package is the venv's): .venv/bin/python for skyrl-0.4, .venv-skyrl-train/bin/python for
#            skyrl-train-0.3.1 (scripts/setup.sh makes both)
#   OUT_DIR  gets plain.xml, active.xml, plain.log, active.log, activated.txt
# Env: TIMEOUT per-test seconds (default 60), EXTRA_PYTHONPATH (e.g. a `pip install --target` dir holding
# pytest-asyncio, which the hosts' dev extra has). Hugging Face hub/datasets are offline in both runs (these
# machines have no internet; a download fails at once instead of hanging).
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,20p' "$0"; exit 2; }
HOST=$1; GIT_DIR=$2; PYTHON=$3; OUT=$4; shift 4
case $HOST in
  skyrl-0.4) REV=a9564572eb8e91076be43c1bd5e4615e3de17265; TREE=. ;;   # main, 2026-08-21 (no 0.4.0 tag in it)
  skyrl-train-0.3.1) REV=ce6def0e8f996eb823de4f10d1c0d1528c9a2f6b; TREE=skyrl-train ;;   # "Bump skyrl-train to 0.3.1"
  *) echo "unknown host $HOST" >&2; exit 2 ;;
esac
SCRIPTS=$(cd "$(dirname "$0")" && pwd)
REPO_ROOT=$(dirname "$SCRIPTS")   # this checkout's skyrl_megatron is the one activated
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

# The tests, the pyproject holding their pytest settings and the examples some tests read; not the host's sources.
# (git may name blobs missing from the snapshot elsewhere in the tree; the archive is still complete.)
git --git-dir="$GIT_DIR" archive "$REV" "$TREE/tests" "$TREE/pyproject.toml" "$TREE/examples" | tar -x -C "$WORK"
cat > "$WORK/skyrl_megatron_active.py" <<'EOF'
import os

def pytest_configure(config):
    from skyrl_megatron import activate
    from skyrl_megatron.hosts import current
    activate()
    with open(os.environ["ACTIVATION_NOTE"], "w") as note:  # proof that the active run activated
        note.write(f"skyrl_megatron activated on {current().release.label}\n")
EOF

export PYTHONPATH="$REPO_ROOT:$WORK${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}"
export ACTIVATION_NOTE="$OUT/activated.txt"; rm -f "$ACTIVATION_NOTE"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$WORK/$TREE"
for run in plain active; do
  plugin=(); [ $run = active ] && plugin=(-p skyrl_megatron_active)
  start=$(date +%s)
  "$PYTHON" -m pytest -q -o addopts= -p no:cacheprovider --timeout="${TIMEOUT:-60}" "${plugin[@]}" \
    --junitxml="$OUT/$run.xml" "@$SCRIPTS/host_own_tests/$HOST.args" "$@" > "$OUT/$run.log" 2>&1 || true
  echo "$run: $(( $(date +%s) - start )) s, $(grep -E ' in [0-9.]+s( |$)' "$OUT/$run.log" | tail -n 1)"
done
cat "$ACTIVATION_NOTE" || { echo "the active run did not activate skyrl_megatron" >&2; exit 1; }

"$PYTHON" - "$OUT/plain.xml" "$OUT/active.xml" <<'EOF'
import collections, sys
import xml.etree.ElementTree as ET

def outcomes(path):
    result = {}
    for case in ET.parse(path).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return result

plain, active = outcomes(sys.argv[1]), outcomes(sys.argv[2])
for name, run in (("plain", plain), ("active", active)):
    print(f"{name}: {len(run)} tests", dict(sorted(collections.Counter(run.values()).items())))
diffs = [(t, plain.get(t, "absent"), active.get(t, "absent"))
         for t in sorted(set(plain) | set(active)) if plain.get(t) != active.get(t)]
print(f"differences: {len(diffs)}")
for test, was, now in diffs:
    print(f"  {test}: plain={was} active={now}")
sys.exit(1 if diffs else 0)
EOF
