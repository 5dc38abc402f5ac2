"""Moving a training state between memory and a checkpoint file (the write path and loads)."""
