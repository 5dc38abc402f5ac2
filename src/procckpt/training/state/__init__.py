"""What a checkpoint holds and how it comes back: the payload of ``state.pt``, the resume,
loads checked on the mapping, and the Checkpointer as a group member sees it."""
