#!/bin/bash
# Run the launcher inside an sbatch job so that the job survives its time limit and preemption.
# Used by every launch/*.sh:   exec slurm/run_launcher.sh <launcher arguments...>
#
# The batch shell receives Slurm's signals (--signal=B:USR1@N before the time limit; SIGTERM on
# preemption or scancel) and forwards them to the launcher, which has the learners checkpoint
# and exits 75 (areal_mega.launcher.supervisor.EXIT_REQUEUE). On 75 this script requeues the job
# (same job id, same run directory): the next run resumes from that checkpoint. A cancelled job
# cannot be requeued (Slurm refuses); resubmit it to resume.
set -uo pipefail
python -m areal_mega.launcher slurm "$@" &
pid=$!
trap 'kill -s USR1 "$pid" 2>/dev/null' USR1
trap 'kill -s TERM "$pid" 2>/dev/null' TERM
trap 'kill -s INT "$pid" 2>/dev/null' INT
# `wait` returns early (status > 128) when a trapped signal arrives: wait until the launcher is gone.
while true; do
  wait "$pid"
  rc=$?
  kill -0 "$pid" 2>/dev/null || break
done
if [ "$rc" -eq 75 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  echo "run_launcher: the learners checkpointed after a signal; requeueing job $SLURM_JOB_ID" >&2
  scontrol requeue "$SLURM_JOB_ID" || echo "run_launcher: Slurm refused the requeue (cancelled?); resubmit to resume" >&2
fi
exit "$rc"
