"""The write path: the host arena, the step fence, the streaming and direct writers, the
background saver, frozen weights written once, and one process's checkpoints recorded once
durable (``saving``)."""
