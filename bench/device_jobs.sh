#!/bin/bash
# Jobs on a lent GPU machine that outlive one call: started detached in one call, waited for by the next calls,
# each poll copying the jobs' logs and results into $OUT (a machine released 30 s after a call returns takes /tmp
# with it, and a job in flight with it).
#
#   call k (after device_setup.sh's parts):
#       bash bench/device_jobs.sh start "python bench/checkpoint_steps.py --out \$JOBS/out/ck06 --modes async" \
#                                       "python bench/checkpoint_steps.py --out \$JOBS/out/ck06s --modes sync"
#   calls k+1, ... (each right after the last returns):
#       bash bench/device_jobs.sh poll 540
#
# The jobs run one after another (each measures with the machine to itself), with device_setup.sh's environment
# where the machine has it; a failed job does not stop the next. `poll SECONDS` returns when every job is done or
# after SECONDS, prints each job's state and last lines, and writes $OUT/<name of $JOBS>.tgz: the jobs' logs, exit statuses
# and everything under $JOBS/out below 20 MB (write results there; checkpoints and models elsewhere).
# $JOBS is /tmp/jobs unless set. Two queues side by side (one GPU each on a 2-GPU machine): a $JOBS each,
#       JOBS=/tmp/jobs_a bash bench/device_jobs.sh start "CUDA_VISIBLE_DEVICES=0 python ..."; JOBS=/tmp/jobs_b ... start ...
#       JOBS=/tmp/jobs_a bash bench/device_jobs.sh poll 500; JOBS=/tmp/jobs_b bash bench/device_jobs.sh poll 5
set -u
JOBS=${JOBS:-/tmp/jobs}
export JOBS

_state() {
    local i=$1
    if [ -f "$JOBS/job_$i.rc" ]; then echo "exit $(cat "$JOBS/job_$i.rc")"
    elif [ -f "$JOBS/job_$i.log" ]; then echo "running"
    else echo "waiting"; fi
}

case "${1:-}" in
  start)
    shift
    [ $# -gt 0 ] || { echo "device_jobs: start needs one or more commands" >&2; exit 2; }
    if [ -f "$JOBS/run.sh" ] && [ ! -f "$JOBS/ALL_DONE" ]; then
        echo "device_jobs: jobs started earlier are still running ($JOBS)" >&2; exit 1
    fi
    rm -rf "$JOBS" && mkdir -p "$JOBS/out"
    i=0
    for command in "$@"; do i=$((i + 1)); printf '%s\n' "$command" > "$JOBS/cmd_$i.sh"; done
    {
        echo "cd '$PWD'"
        # the set-up's environment, the skyrl 0.4 set's where s1-s3 ran (it sets -e: the jobs must not stop at a failed command)
        echo "if [ -d /tmp/site04 ]; then source bench/device_setup.sh env04; elif [ -d /tmp/site ]; then source bench/device_setup.sh env; fi; set +e"
        for j in $(seq 1 "$i"); do
            echo "date -u +%FT%TZ > '$JOBS/job_$j.started'"
            echo "bash '$JOBS/cmd_$j.sh' > '$JOBS/job_$j.log' 2>&1 < /dev/null; echo \$? > '$JOBS/job_$j.rc'"
        done
        echo "date -u +%FT%TZ > '$JOBS/ALL_DONE'"
    } > "$JOBS/run.sh"
    setsid nohup bash "$JOBS/run.sh" > "$JOBS/runner.log" 2>&1 < /dev/null &
    echo "device_jobs: $i job(s) started in $JOBS"
    ;;
  poll)
    limit=${2:-540}
    [ -f "$JOBS/run.sh" ] || { echo "device_jobs: nothing started in $JOBS" >&2; exit 1; }
    waited=0
    while [ ! -f "$JOBS/ALL_DONE" ] && [ "$waited" -lt "$limit" ]; do sleep 5; waited=$((waited + 5)); done
    for cmd in "$JOBS"/cmd_*.sh; do
        i=${cmd##*cmd_}; i=${i%.sh}
        echo "== job $i ($(_state "$i")): $(head -c 200 "$cmd")"
        [ -f "$JOBS/job_$i.log" ] && tail -n "${TAIL_LINES:-4}" "$JOBS/job_$i.log" | cut -c1-400
    done
    [ -f "$JOBS/ALL_DONE" ] && echo "device_jobs: all done" || echo "device_jobs: still running after ${waited} s"
    if [ -n "${OUT:-}" ]; then
        (cd "$(dirname "$JOBS")" && find "$(basename "$JOBS")" -type f -size -20M | tar czf "$OUT/$(basename "$JOBS").tgz" -T -)
        echo "device_jobs: $OUT/$(basename "$JOBS").tgz"
    fi
    ;;
  *)
    echo "usage: bash bench/device_jobs.sh start COMMAND... | bash bench/device_jobs.sh poll [SECONDS]" >&2
    exit 2
    ;;
esac
