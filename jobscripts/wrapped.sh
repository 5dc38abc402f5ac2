#!/bin/bash
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@60
# from jobscripts/my-job.sbatch:
#SBATCH -J resnet50
#SBATCH -p gpu
#SBATCH -t 8:00:00
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
# Written by: procckpt sbatch -- jobscripts/my-job.sbatch
#
# procckpt checkpoints the command before the time limit (when Slurm sends SIGUSR1 to this
# batch shell 60 s before the limit, or at the end time it reads from Slurm), requeues the
# job with `scontrol requeue`, and resumes from the checkpoint when Slurm starts the job
# again. --open-mode=append keeps the output of every cycle in one log.
#
# `exec` makes procckpt the batch shell itself, so that the signal reaches it; procckpt
# passes the request on to the training through its checkpoint dir, never as a raw signal
# (NCCL handles SIGUSR1 itself, DMTCP uses SIGUSR2).
exec procckpt run -- bash jobscripts/my-job.sbatch
