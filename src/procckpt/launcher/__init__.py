"""The launcher side of ``procckpt run``: supervise the command, watch the deadline, ask for
checkpoints, stop, restart or requeue. It never imports torch."""
