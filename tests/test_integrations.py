"""The framework adapters' own decisions, without running a framework's training loop
(tests/e2e/test_frameworks.py and test_sharded_frameworks.py run them)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from procckpt.errors import ProcckptError
from procckpt.store import CheckpointStore
from procckpt.training.group import Sharded
from procckpt.training.sharded.dcp import dcp_state

pytestmark = pytest.mark.unit

lightning_missing = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                       reason="lightning is not installed")


class _Entries(Sharded):
    """A framework's sharded checkpoint with fixed entries."""

    procckpt_framework = True

    def __init__(self, entries: dict) -> None:
        self.entries = entries

    def state_dict(self) -> dict:
        return self.entries


def test_a_frameworks_sharded_entries_go_at_the_top_of_dcps_checkpoint_beside_named_state():
    model = torch.nn.Linear(2, 2)
    state = dcp_state({"train": Sharded(model),
                       "framework": _Entries({"state_dict": {"w": 1}, "optimizer_0": {}})})
    assert set(state) == {"train", "state_dict", "optimizer_0"}
    assert set(state["train"]["model"]) == {"weight", "bias"}
    with pytest.raises(ProcckptError, match="named like other state: train"):
        dcp_state({"train": Sharded(model), "framework": _Entries({"train": {}})})


@lightning_missing
def test_lightnings_fsdp1_and_deepspeed_strategies_are_refused_with_what_to_use():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from procckpt.integrations.lightning import _LightningShards, _sharded_state

    with pytest.raises(ProcckptError, match="FSDPStrategy is not saved by procckpt: use "
                                            "ModelParallelStrategy"):
        _sharded_state(SimpleNamespace(strategy=FSDPStrategy()))
    assert _sharded_state(SimpleNamespace(strategy=DDPStrategy())) is None
    shards = _sharded_state(SimpleNamespace(strategy=ModelParallelStrategy()))
    assert isinstance(shards, _LightningShards)


@lightning_missing
def test_lightnings_metadata_file_is_the_checkpoints_state_file_under_the_manifest(
        tmp_path: Path):
    from procckpt.integrations.lightning import _add_metadata_file

    store = CheckpointStore(tmp_path / "d").open()
    store.adopt = _add_metadata_file
    with store.begin({"step": 1}) as pending:
        with pending.open("state.pt") as f:
            f.write(b"lightning's dictionary")
        info = pending.commit()
    assert info.manifest["files"]["meta.pt"] == info.manifest["files"]["state.pt"]
    assert os.path.samefile(info.path / "meta.pt", info.path / "state.pt")
    assert store.newest_intact() is not None and store.newest_intact().path == info.path


@lightning_missing
@pytest.mark.parametrize("under_procckpt", [True, False], ids=["procckpt-run", "alone"])
def test_lightnings_own_slurm_requeue_is_off_only_under_procckpt_run(monkeypatch,
                                                                      under_procckpt: bool):
    import lightning as L

    from procckpt.integrations.lightning import _leave_requeue_to_procckpt

    for name, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7",
                        "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                        "SLURM_NODELIST": "n1"}.items():
        monkeypatch.setenv(name, value)
    if under_procckpt:
        monkeypatch.setenv("PROCCKPT_TOKEN", "t")
    else:
        monkeypatch.delenv("PROCCKPT_TOKEN", raising=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    environment = trainer._accelerator_connector.cluster_environment
    assert type(environment).__name__ == "SLURMEnvironment" and environment.auto_requeue
    _leave_requeue_to_procckpt(trainer)
    assert environment.auto_requeue is not under_procckpt
