"""Adapters for training frameworks that run the loop themselves: ``lightning`` (a
``Callback``) and ``transformers`` (a ``TrainerCallback``). Each module is imported by the user
alone; ``import procckpt`` imports no framework. Accelerate needs none: its prepared loader goes
through ``ckpt.batches()`` like any other."""
