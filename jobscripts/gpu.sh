#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@60
#SBATCH -t 12:00:00
#SBATCH -p gpu
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=32
#SBATCH --mem=200G
#SBATCH -J ddp
# Written by: procckpt sbatch -t 12:00:00 -p gpu --gres=gpu:4 --cpus-per-task=32 --mem=200G -J ddp --max-restarts 50 -- torchrun --standalone --nproc-per-node=4 train.py
#
# procckpt checkpoints the command before the time limit (when Slurm sends SIGUSR1 to this
# batch shell 60 s before the limit, or at the end time it reads from Slurm), requeues the
# job with `scontrol requeue`, and resumes from the checkpoint when Slurm starts the job
# again. --open-mode=append keeps the output of every cycle in one log.
#
# `exec` makes procckpt the batch shell itself, so that the signal reaches it; procckpt
# passes the request on to the training through its checkpoint dir, never as a raw signal
# (NCCL handles SIGUSR1 itself, DMTCP uses SIGUSR2).
exec procckpt run --max-restarts 50 -- torchrun --standalone --nproc-per-node=4 train.py
