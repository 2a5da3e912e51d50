#!/bin/bash
# Stacks of a running job, every INTERVAL seconds until it ends: py-spy (carried in .whl5) dumps the
# Python process under PID (the first python among PID and its descendants: `timeout` and shells are
# skipped) and every Ray worker process, appending to one file (the device returns at most 8 files).
#   bash bench/pyspy_watch.sh PID OUT_FILE [INTERVAL]
set -u
PID=$1 OUT=$2 INTERVAL=${3:-15}
START=$(date +%s)
python_of() {  # the pid itself if it runs python, else the first python descendant
    local pid=$1
    while [ -n "$pid" ]; do
        grep -q python "/proc/$pid/cmdline" 2>/dev/null && { echo "$pid"; return; }
        pid=$(pgrep -P "$pid" | head -1)
    done
}
while kill -0 "$PID" 2>/dev/null; do
    sleep "$INTERVAL"
    T=$(( $(date +%s) - START ))
    DRIVER=$(python_of "$PID")
    {
        echo "=== t=${T}s driver pid ${DRIVER:-none}"
        [ -n "$DRIVER" ] && py-spy dump --pid "$DRIVER" 2>&1
        for WORKER in $(pgrep -f "ray::" | head -8); do
            echo "=== t=${T}s pid $WORKER $(tr '\0' ' ' < /proc/$WORKER/cmdline 2>/dev/null | cut -c1-80)"
            py-spy dump --pid "$WORKER" 2>&1 | grep -v "^ *$"
        done
    } >> "$OUT" 2>&1
done
