"""launcher/warm.py: which commands a spare interpreter can run, and how it would run them."""

from __future__ import annotations

import pytest

from procckpt.launcher.warm import Target, warm_target

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit


@pytest.mark.parametrize("command, interpreter, script, module, args", [
    (["python", "train.py", "--lr", "3"], ["python"], "train.py", None, ["--lr", "3"]),
    (["/usr/bin/python3.11", "-u", "t.py"], ["/usr/bin/python3.11", "-u"], "t.py", None, []),
    (["python3", "-uB", "-W", "ignore", "-Xfaulthandler", "t.py", "-m", "x"],
     ["python3", "-uB", "-W", "ignore", "-Xfaulthandler"], "t.py", None, ["-m", "x"]),
    (["python", "-m", "pkg.train", "--epochs", "3"], ["python"], None, "pkg.train",
     ["--epochs", "3"]),
    (["python", "-O", "-m", "pkg"], ["python", "-O"], None, "pkg", []),
])
def test_a_python_script_or_module_is_served(command, interpreter, script, module, args):
    target = warm_target(command)
    assert isinstance(target, Target)
    assert (target.interpreter, target.script, target.module, target.args) == \
        (interpreter, script, module, args)


@pytest.mark.parametrize("command, why", [
    (["torchrun", "--nproc-per-node", "2", "t.py"], "is not `python script.py`"),
    (["sh", "-c", "python t.py"], "is not `python script.py`"),
    (["python", "-m", "torch.distributed.run", "t.py"], "torchrun starts its ranks itself"),
    (["python", "-c", "print(1)"], "option -c is not one"),
    (["python", "-I", "t.py"], "option -I is not one"),
    (["python"], "runs no script"),
    (["python", "-m"], "runs no module"),
])
def test_other_commands_start_cold_with_the_reason(command, why):
    target = warm_target(command)
    assert isinstance(target, str) and why in target, target


def test_the_script_directory_comes_first_on_the_path_as_python_puts_it(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "t.py").write_text("")
    (tmp_path / "link.py").symlink_to(tmp_path / "real" / "t.py")
    target = warm_target(["python", "link.py"])
    assert isinstance(target, Target)
    assert target.path0(str(tmp_path)) == str(tmp_path / "real")  # links resolved
    module = warm_target(["python", "-m", "pkg"])
    assert isinstance(module, Target) and module.path0(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("env, served", [
    ({}, True), ({"WORLD_SIZE": "1"}, True), ({"WORLD_SIZE": "4", "RANK": "1"}, False),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, True),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, False),
])
def test_a_rank_of_a_group_starts_cold(monkeypatch, caplog, env, served):
    from procckpt.launcher.warm import warm_restarts

    for name in ("WORLD_SIZE", "RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    caplog.set_level("INFO", logger="procckpt")
    with warm_restarts(True, "hooks", ["python", "t.py"], True) as warm:
        assert (warm is not None) == served
    assert ("not for a rank of a group" in caplog.text) == (not served), caplog.text


def test_the_dmtcp_engine_and_several_nodes_start_cold(caplog):
    from procckpt.launcher.warm import warm_restarts

    caplog.set_level("INFO", logger="procckpt")
    with warm_restarts(True, "dmtcp", ["python", "t.py"], True) as warm:
        assert warm is None
    with warm_restarts(True, "hooks", ["python", "t.py"], False) as warm:
        assert warm is None
    assert "not with the dmtcp engine" in caplog.text
    assert "not for a run on several nodes" in caplog.text


def test_a_spare_that_died_gives_way_to_a_cold_start(tmp_path, caplog):
    """The spare (and its keeper) gone between the look that found it alive and the hand-over:
    the cycle starts cold, as it would have without warm restarts, and says so."""
    import os
    import sys
    import time

    import psutil

    from procckpt.launcher.warm import Spare, WarmChild

    script = tmp_path / "t.py"
    script.write_text("import sys; open(sys.argv[1], 'w').write('ran')\n")
    target = Target([sys.executable], str(script), None, [str(tmp_path / "out")])
    spare = Spare(target, dict(os.environ), str(tmp_path))
    keeper = psutil.Process(spare.pid)
    while not (below := keeper.children()):
        time.sleep(0.01)
    below[0].kill()
    spare.popen.wait(timeout=30)
    child = WarmChild([sys.executable, str(script), str(tmp_path / "out")], dict(os.environ),
                      spare, target)
    caplog.set_level("WARNING", logger="procckpt")
    child.start()
    assert not child.warm and "could not take the cycle" in caplog.text, caplog.text
    assert child.wait(30) == 0
    assert (tmp_path / "out").read_text() == "ran"
