"""Moving a training state between memory and a checkpoint file: writer, host arena, background saver, mapped loads."""
