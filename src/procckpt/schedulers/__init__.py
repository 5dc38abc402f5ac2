"""What the launcher knows of schedulers: Slurm's deadline, requeue and ``sbatch`` job
scripts; Kubernetes Job manifests."""
