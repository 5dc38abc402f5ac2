#!/bin/bash
#SBATCH --array=1-10%1
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@60
#SBATCH --output=slurm-%A.out
#SBATCH -t 4:00:00
#SBATCH -J train
# Written by: procckpt sbatch --chain 10 -t 4:00:00 -J train -- python train.py
#
# Chain mode, for sites that do not allow requeue: the job is an array of 10 tasks that run
# one after another (%1). procckpt checkpoints the command before each task's time limit
# (when Slurm sends SIGUSR1 to this batch shell 60 s before the limit, or at the end time it
# reads from Slurm) and stops; the next task resumes from the checkpoint. Once the training
# has finished, the remaining tasks exit at once.
#
# `exec` makes procckpt the batch shell itself, so that the signal reaches it; procckpt
# passes the request on to the training through its checkpoint dir, never as a raw signal
# (NCCL handles SIGUSR1 itself, DMTCP uses SIGUSR2).
export PROCCKPT_SLURM_CHAIN=1
exec procckpt run -- python train.py
