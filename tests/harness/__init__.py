"""What the tests stand on: a Slurm cluster on loopback (slurm_cluster.py, slurm_nodes.py),
helpers for driving real processes (processes.py) and the training programs they run
(programs/)."""
