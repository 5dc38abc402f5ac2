"""training/state/vml.py: torch's CPU vector math settled once per process, in a fresh process
(the state it settles is per process), as a Checkpointer does before the first step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .conftest import PYTHON

FRESH = """
import json, sys, torch
torch.set_num_threads(2)
from procckpt.training.state import vml
v = torch.rand(8192, generator=torch.Generator().manual_seed(0), dtype=torch.float32) + 1e-3
model = torch.nn.Linear(2, 2)
rng = torch.get_rng_state()
ckpt = __import__("procckpt").Checkpointer(sys.argv[1], model=model)
first, again = v.sqrt(), v.sqrt()
print(json.dumps({"settled": vml._settled, "twice": vml.settle_vector_math(),
                  "rng_kept": torch.equal(rng, torch.get_rng_state()),
                  "first_differs": int((first != again).sum())}))
"""


def test_a_checkpointer_settles_the_vector_math_once_and_changes_nothing(tmp_path: Path):
    done = subprocess.run([PYTHON, "-c", FRESH, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120, env={"OMP_NUM_THREADS": "2", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"settled": True, "twice": False, "rng_kept": True, "first_differs": 0}
