"""The training side: the ``Checkpointer`` inside the user's script (safe points, payload,
RNG, resume), its writer and arena, and process groups."""
