"""State split across ranks in DCP's format: the safe reader (``dcp``), DCP's files written by
procckpt's streaming writer (``files``), the save plan made once per layout (``plans``), copies
written in the background (``copies``), frozen shards written once (``frozen``)."""
