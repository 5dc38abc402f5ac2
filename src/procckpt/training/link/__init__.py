"""The training side's link to the launcher: what it is told in the environment (context),
what asks for a checkpoint (triggers), the heartbeat (liveness), a rank's failure (failures)
and the times the goodput needs (timing)."""
