#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH -t 4:00:00
#SBATCH --gres=gpu:1
# Written by: procckpt sbatch -t 4:00:00 --gres=gpu:1 '--container-image=nvcr.io#nvidia/pytorch:24.01-py3' --container-mounts=/scratch:/scratch --dir /scratch/me/ckpt -- python train.py
#
# Container mode (Pyxis): procckpt runs inside the container, where scontrol and squeue are
# missing. It learns the job's end time from PROCCKPT_SLURM_END_TIME (set below),
# checkpoints before it and exits with 75; this shell, outside the container, then requeues
# the job (unless it got SIGTERM: scancel or preemption).
#
# No --signal: a signal sent into the srun step would reach the training processes too.
set -u
max_restarts=20
stopped_by_slurm=0
trap 'stopped_by_slurm=1' TERM
if end_time="$(squeue -h -j "$SLURM_JOB_ID" -o %e)" && end_epoch="$(date -d "$end_time" +%s)"; then
    export PROCCKPT_SLURM_END_TIME="$end_epoch"
fi
srun --ntasks=1 '--container-image=nvcr.io#nvidia/pytorch:24.01-py3' --container-mounts=/scratch:/scratch procckpt run --dir /scratch/me/ckpt -- python train.py
rc=$?
if [ "$rc" -eq 75 ] && [ "$stopped_by_slurm" -eq 0 ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$max_restarts" ]; then
        echo "procckpt sbatch: restart budget exhausted (${SLURM_RESTART_COUNT:-0} of $max_restarts); not requeued" >&2
    elif [ -n "${SLURM_ARRAY_JOB_ID:-}" ]; then
        scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" && exit 0
    else
        scontrol requeue "$SLURM_JOB_ID" && exit 0
    fi
fi
exit "$rc"
