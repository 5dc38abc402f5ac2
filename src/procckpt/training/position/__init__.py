"""Where the training is, exactly: the step and epoch, the random streams (progress, rng), and
how a data loader is opened at a batch of its epoch (loaders; probe tells skip from replay)."""
