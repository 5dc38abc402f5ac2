"""Reading a checkpoint dir after the fact, from any machine: ``procckpt status`` (status.py),
``procckpt report`` (report.py), and where the run's time went (goodput.py), from the files
and the events journal alone."""
