"""--engine auto|hooks|dmtcp|criu: which engine runs a command, and the reason given.

The DMTCP installation and its test launch are seams here (``find``, ``probe``), and CRIU a
shell script that says a version (``PROCCKPT_CRIU``); the end-to-end tests in
tests/e2e/test_dmtcp.py and test_criu.py run the real ones.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from procckpt.errors import UsageError
from procckpt.launcher.engines.choice import choose_engine, cuda_visible, imports_procckpt
from procckpt.launcher.engines.criu import CriuProblem, CriuTools, criu_problem
from procckpt.launcher.engines.dmtcp import DmtcpTools
from procckpt.store import CheckpointStore

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

TOOLS = DmtcpTools("/opt/d/dmtcp_launch", "/opt/d/dmtcp_restart", "/opt/d/dmtcp_command",
                   "/opt/d/dmtcp_coordinator")
NO_GPU: dict[str, str] = {"CUDA_VISIBLE_DEVICES": ""}
NO_CRIU = (None, CriuProblem("criu is not on PATH", "--engine criu needs CRIU, but ..."))
CRIU = (CriuTools("/opt/c/criu", (4, 2)), None)


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt").open()


def write_script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def choose(store: CheckpointStore, command: list[str], tmp_path: Path, requested: str = "auto",
           environ: dict[str, str] | None = None, tools: DmtcpTools | None = TOOLS,
           probe_result: str | None = None, criu=NO_CRIU):
    """``criu``: what the CRIU check answers; None: the real check of $PROCCKPT_CRIU."""
    return choose_engine(requested, command, store, environ=NO_GPU if environ is None else environ,
                         cwd=tmp_path, find=lambda: tools, probe=lambda t: probe_result,
                         criu=None if criu is None else lambda: criu, dev=tmp_path / "dev")


def commit(store: CheckpointStore, engine: str) -> None:
    with store.begin({"engine": engine}) as pending:
        with pending.open("payload") as f:
            f.write(b"x")
        pending.commit()


@pytest.mark.parametrize("source", [
    "import procckpt\n",
    "import os\nfrom procckpt import Checkpointer\n",
    "from procckpt.state import Checkpointer\n",
    "if True:\n    import procckpt as p\n",
    "import sys, torch as t, procckpt\n",
])
def test_a_script_importing_procckpt_gets_hooks(tmp_path, store, source):
    write_script(tmp_path, "train.py", source)
    choice = choose(store, ["python", "train.py", "--epochs", "3"], tmp_path)
    assert choice.name == "hooks"
    assert choice.reason == "train.py imports procckpt"


def test_a_script_importing_procckpt_through_its_own_modules_gets_hooks(tmp_path, store):
    write_script(tmp_path, "train.py", "import os\nfrom mingpt.trainer import Trainer\n")
    write_script(tmp_path, "mingpt/__init__.py", "")
    write_script(tmp_path, "mingpt/trainer.py", "from .utils import setup\n")
    write_script(tmp_path, "mingpt/utils.py", "import torch\nimport procckpt\n")
    choice = choose(store, ["python", "train.py"], tmp_path)
    assert (choice.name, choice.reason) == (
        "hooks", "train.py (through mingpt/utils.py) imports procckpt")
    write_script(tmp_path, "mingpt/utils.py", "import torch\n")  # nowhere now
    assert choose(store, ["python", "train.py"], tmp_path).name == "dmtcp"


def test_a_plain_script_gets_dmtcp_when_it_is_installed(tmp_path, store):
    write_script(tmp_path, "train.py", "import torch  # no procckpt here\n# import procckpt\n")
    choice = choose(store, ["python", "train.py"], tmp_path)
    assert (choice.name, choice.tools) == ("dmtcp", TOOLS)
    assert "does not import procckpt" in choice.reason


def test_module_and_inline_code_are_read(tmp_path, store):
    write_script(tmp_path, "pkg/train.py", "from procckpt import Checkpointer\n")
    assert choose(store, ["python", "-m", "pkg.train"], tmp_path).name == "hooks"
    write_script(tmp_path, "app/__main__.py", "import procckpt\n")
    assert choose(store, ["python", "-m", "app"], tmp_path).name == "hooks"
    assert choose(store, ["python", "-c", "import procckpt; print(1)"], tmp_path).name == "hooks"
    assert choose(store, ["python", "-c", "print(1)"], tmp_path).name == "dmtcp"
    assert imports_procckpt(["sh", "-c", "exit 7"], tmp_path) is None
    assert imports_procckpt(["python", "-m", "procckpt.bench", "worker"], tmp_path) == \
        "procckpt.bench"
    # torchrun as a module: the script it launches is the one read.
    write_script(tmp_path, "ddp.py", "import procckpt\n")
    assert choose(store, ["python", "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "ddp.py"], tmp_path).name == "hooks"


@pytest.mark.parametrize("command", [
    ["sh", "-c", "python train.py --epochs 3"],
    ["bash", "-lc", "set -e; OMP_NUM_THREADS=1 exec python3 train.py 2>&1 | tee log"],
    ["/bin/sh", "-ec", "echo start && srun --ntasks 2 python -m pkg.train # python other.py"],
    ["bash", "--norc", "-c", "cd sub && python 'my train.py'"],
    ["bash", "-o", "pipefail", "-euc", "python train.py | tee log"],
])
def test_a_shell_running_a_procckpt_script_inline_gets_hooks(tmp_path, store, command):
    for name in ("train.py", "pkg/train.py", "sub/my train.py"):
        write_script(tmp_path, name, "import procckpt\n")
    write_script(tmp_path, "other.py", "print('no procckpt')\n")
    choice = choose(store, command, tmp_path)
    assert choice.name == "hooks", choice.reason
    assert choice.reason.endswith("imports procckpt")


@pytest.mark.parametrize("command", [
    ["sh", "-c", "python other.py && echo 'python train.py'"],  # quoted text is no command
    ["sh", "run.sh"],  # a script file: not read
    ["sh", "-c", "python 'train.py"],  # unbalanced quote: the shell would refuse it
    ["bash", "--", "-c", "python train.py"],
])
def test_a_shell_that_does_not_run_a_procckpt_script_inline_gets_dmtcp(tmp_path, store,
                                                                      command):
    write_script(tmp_path, "train.py", "import procckpt\n")
    write_script(tmp_path, "other.py", "print('no procckpt')\n")
    write_script(tmp_path, "run.sh", "python train.py\n")
    assert choose(store, command, tmp_path).name == "dmtcp"


def test_without_dmtcp_auto_falls_back_to_hooks_and_says_why(tmp_path, store):
    choice = choose(store, ["sh", "-c", "true"], tmp_path, tools=None)
    assert choice.name == "hooks"
    assert "DMTCP is not installed (no dmtcp_launch on PATH)" in choice.reason


def test_engine_dmtcp_without_dmtcp_is_a_one_line_error_saying_how_to_get_it(tmp_path, store):
    with pytest.raises(UsageError) as err:
        choose(store, ["python", "train.py"], tmp_path, requested="dmtcp", tools=None)
    message = str(err.value)
    assert "\n" not in message
    assert "dmtcp_launch is not on PATH" in message and "module load dmtcp" in message


def test_visible_gpus_keep_auto_on_hooks_and_warn_under_engine_dmtcp(tmp_path, store, caplog):
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    choice = choose(store, ["python", "-c", "pass"], tmp_path, environ=gpu_env)
    assert choice.name == "hooks" and "CUDA_VISIBLE_DEVICES=0,1" in choice.reason
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        forced = choose(store, ["python", "-c", "pass"], tmp_path, requested="dmtcp",
                        environ=gpu_env)
    assert forced.name == "dmtcp"
    assert "DMTCP cannot checkpoint a process that uses CUDA" in caplog.text
    assert "--engine hooks" in caplog.text


def test_visible_gpus_warn_under_engine_criu(tmp_path, store, caplog):
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        forced = choose(store, ["python", "-c", "pass"], tmp_path, requested="criu",
                        environ={"CUDA_VISIBLE_DEVICES": "0"}, criu=CRIU)
    assert forced.name == "criu"
    assert "CRIU cannot image a process that uses CUDA" in caplog.text
    assert "--engine hooks" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        choose(store, ["python", "-c", "pass"], tmp_path, requested="criu", environ={},
               criu=CRIU)
    assert "CUDA" not in caplog.text


def test_engine_criu_without_a_usable_criu_is_its_one_line(tmp_path, store):
    with pytest.raises(UsageError) as err:
        choose(store, ["python", "train.py"], tmp_path, requested="criu", criu=NO_CRIU)
    assert str(err.value) == NO_CRIU[1].message


def test_cuda_visible_reads_the_variable_then_the_device_files(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    assert cuda_visible({}, dev) is None
    assert cuda_visible({"CUDA_VISIBLE_DEVICES": "-1"}, dev) is None
    assert cuda_visible({"CUDA_VISIBLE_DEVICES": "GPU-12"}, dev) == "CUDA_VISIBLE_DEVICES=GPU-12"
    (dev / "nvidia0").touch()
    (dev / "nvidiactl").touch()
    assert cuda_visible({}, dev) == f"1 NVIDIA device(s) in {dev}"
    assert cuda_visible({"CUDA_VISIBLE_DEVICES": ""}, dev) is None


def test_a_failed_test_launch_keeps_auto_on_hooks(tmp_path, store):
    choice = choose(store, ["python", "-c", "pass"], tmp_path,
                    probe_result="a test launch under dmtcp_launch failed (exit 1: boom)")
    assert choice.name == "hooks"
    assert choice.reason == "DMTCP is installed but a test launch under dmtcp_launch failed " \
                            "(exit 1: boom); not CRIU: criu is not on PATH"


def test_existing_checkpoints_decide_so_a_run_never_switches_engines(tmp_path, store):
    write_script(tmp_path, "train.py", "import procckpt\n")
    commit(store, "dmtcp")
    choice = choose(store, ["python", "train.py"], tmp_path)
    assert choice.name == "dmtcp" and choice.reason == "the checkpoint dir holds DMTCP images"
    with pytest.raises(UsageError, match="module load dmtcp"):
        choose(store, ["python", "train.py"], tmp_path, tools=None)
    with pytest.raises(UsageError, match="hooks engine cannot resume"):
        choose(store, ["python", "train.py"], tmp_path, requested="hooks")
    commit(store, "hooks")
    plain = choose(store, ["python", "-c", "pass"], tmp_path)
    assert plain.name == "hooks" and plain.reason == "the checkpoint dir holds hooks checkpoints"


def fake_launch(tmp_path: Path, crashes: int) -> DmtcpTools:
    """A dmtcp_launch stand-in whose first ``crashes`` launches end as a crashed child does
    under DMTCP (exit 1, the traceback's last line), then run the program: the crash is the
    seam, rare and not reproducible with the real DMTCP on demand."""
    count = tmp_path / "launches"
    launch = write_script(tmp_path, "dmtcp_launch", f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}
if [ "$n" -lt {crashes} ]; then echo "died with <Signals.SIGSEGV: 11>." >&2; exit 1; fi
while [ "$1" != "-q" ]; do shift; done; shift 2; exec "$@"
""")
    launch.chmod(0o755)
    return DmtcpTools(str(launch), "/x/dmtcp_restart", "/x/dmtcp_command", "/x/coordinator")


def test_one_crashed_test_launch_is_tried_again_and_two_keep_auto_on_hooks(tmp_path, caplog):
    from procckpt.launcher.engines.choice import probe_dmtcp

    once = tmp_path / "once"
    with caplog.at_level(logging.WARNING, logger="procckpt"):
        assert probe_dmtcp(fake_launch(once, crashes=1)) is None
    assert "failed (exit 1: died with <Signals.SIGSEGV: 11>.); a second one passed: DMTCP " \
           "is used" in caplog.text
    twice = tmp_path / "twice"
    assert probe_dmtcp(fake_launch(twice, crashes=2)) == \
        "a test launch under dmtcp_launch failed (exit 1: died with <Signals.SIGSEGV: 11>.)"
    assert (twice / "launches").read_text().strip() == "2"


def _fake_criu(tmp_path: Path, version: str, name: str = "criu") -> Path:
    """A criu stand-in: its version, and a `check` that passes as root and, as another user
    (``check --unprivileged``), fails as a binary without capabilities does."""
    binary = tmp_path / name
    binary.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 'Version: {version}' && "
                      "exit 0\n[ \"$2\" = --unprivileged ] && echo 'Warn  (criu/kerndat.c:1200):"
                      " $XDG_RUNTIME_DIR not set' && echo 'CRIU needs to have the CAP_SYS_ADMIN "
                      "or the CAP_CHECKPOINT_RESTORE capability: ' && exit 1\n"
                      "echo 'Looks good.'\n")
    binary.chmod(0o755)
    return binary


def test_engine_criu_refuses_in_one_line_what_cannot_image_here(tmp_path, store, monkeypatch):
    monkeypatch.setenv("PROCCKPT_CRIU", str(tmp_path / "none"))
    with pytest.raises(UsageError, match=r"needs CRIU, but .*/none is not an executable"):
        choose(store, ["python", "x.py"], tmp_path, requested="criu", criu=None)
    monkeypatch.setenv("PROCCKPT_CRIU", str(_fake_criu(tmp_path, "3.17")))
    with pytest.raises(UsageError, match=r"is CRIU 3\.17, which cannot image processes on "
                                         r"kernels from 6\.13"):
        choose(store, ["python", "x.py"], tmp_path, requested="criu", criu=None)
    fake = _fake_criu(tmp_path, "4.2")
    tools, problem = criu_problem(str(fake), euid=1000)
    assert tools is None and problem == (
        f"--engine criu as a user other than root needs CRIU's capabilities, and `{fake} check "
        "--unprivileged` fails on this machine (CRIU needs to have the CAP_SYS_ADMIN or the "
        "CAP_CHECKPOINT_RESTORE capability): run as root, or have an administrator give the "
        f"binary its capabilities (setcap cap_checkpoint_restore,cap_sys_ptrace,cap_setpcap+eip "
        f"{fake}; Linux 5.9 or newer), or use --engine hooks")
    tools, problem = criu_problem(str(fake), euid=0)
    assert problem is None and tools is not None and tools.version == (4, 2)
    assert not tools.unprivileged and tools.options == []


def test_a_dir_of_criu_images_keeps_criu_and_refuses_hooks(tmp_path, store, monkeypatch):
    monkeypatch.setenv("PROCCKPT_CRIU", str(_fake_criu(tmp_path, "4.2")))
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    commit(store, "criu")
    choice = choose(store, ["python", "x.py"], tmp_path, criu=None)
    assert choice.name == "criu" and choice.reason == "the checkpoint dir holds CRIU images"
    with pytest.raises(UsageError, match="holds CRIU images, which the hooks engine cannot "
                                         "resume: run with --engine criu"):
        choose(store, ["python", "x.py"], tmp_path, requested="hooks")


def test_the_stdout_and_stderr_of_an_image_are_handed_over_once_each():
    from procckpt.launcher.engines.criu.engine import _handed_over
    from procckpt.store import CheckpointInfo

    def image(fds: dict[str, str]) -> CheckpointInfo:
        return CheckpointInfo(Path("/x/ckpt-00000001"), 1, {"criu": {"fds": fds}})

    assert _handed_over(image({"1": "run/log", "2": "run/log"})) == {1: "run/log"}
    assert _handed_over(image({"1": "pipe:[7]", "2": "run/err"})) == {1: "pipe:[7]",
                                                                     2: "run/err"}
    assert _handed_over(image({})) == {}


def test_auto_prefers_criu_for_a_plain_script_then_dmtcp_then_hooks(tmp_path, store):
    write_script(tmp_path, "train.py", "import torch\n")
    chosen = choose(store, ["python", "train.py"], tmp_path, criu=CRIU)
    assert (chosen.name, chosen.tools, chosen.reason) == (
        "criu", CRIU[0], "the command does not import procckpt and CRIU 4.2 can image it")
    no_criu = choose(store, ["python", "train.py"], tmp_path)
    assert (no_criu.name, no_criu.reason) == (
        "dmtcp", "the command does not import procckpt and DMTCP is installed (not CRIU: criu "
                 "is not on PATH)")
    neither = choose(store, ["python", "train.py"], tmp_path, tools=None)
    assert neither.name == "hooks" and neither.reason.startswith(
        "DMTCP is not installed (no dmtcp_launch on PATH), not CRIU: criu is not on PATH;")
    assert neither.warning is not None and "install CRIU or DMTCP" in neither.warning
    # A script that imports procckpt keeps hooks, and a GPU keeps both images away.
    write_script(tmp_path, "hooked.py", "import procckpt\n")
    assert choose(store, ["python", "hooked.py"], tmp_path, criu=CRIU).name == "hooks"
    gpu = choose(store, ["python", "train.py"], tmp_path, criu=CRIU,
                 environ={"CUDA_VISIBLE_DEVICES": "0"})
    assert gpu.name == "hooks" and "neither CRIU nor DMTCP" in gpu.reason


@pytest.mark.parametrize("command, launcher", [
    (["torchrun", "--nproc-per-node", "2", "train.py"], "torchrun"),
    (["python3", "-m", "torch.distributed.run", "--standalone", "train.py"],
     "python -m torch.distributed.run"),
    (["sh", "-c", "cd run && srun python train.py"], "srun"),
    (["/usr/bin/mpirun", "-n", "4", "python", "train.py"], "mpirun"),
])
def test_a_launcher_of_ranks_is_not_given_to_criu(tmp_path, store, command, launcher):
    write_script(tmp_path, "train.py", "import torch\n")
    (tmp_path / "run").mkdir()
    write_script(tmp_path, "run/train.py", "import torch\n")
    chosen = choose(store, command, tmp_path, criu=CRIU)
    assert chosen.name == "dmtcp", chosen.reason
    assert chosen.reason.endswith(f"(not CRIU: {launcher} starts ranks that talk over TCP, "
                                  "which a CRIU image does not hold)")


def test_a_user_other_than_root_uses_criu_unprivileged_where_its_check_passes(tmp_path):
    """A binary whose `check --unprivileged` passes (file capabilities set) is used with
    --unprivileged in every dump and restore."""
    able = tmp_path / "criu"
    able.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'Version: 4.2' && exit 0\n"
                    "echo \"$@\" >> " + str(tmp_path / "calls") + "\necho 'Looks good.'\n")
    able.chmod(0o755)
    tools, problem = criu_problem(str(able), euid=1000)
    assert problem is None and tools is not None
    assert tools.unprivileged and tools.options == ["--unprivileged"]
    assert (tmp_path / "calls").read_text() == "check --unprivileged\n"
