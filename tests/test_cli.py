"""Bad input: one line on stderr that says what to do, a non-zero exit, nothing touched."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .conftest import PYTHON, procckpt_argv, run


def one_line_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("procckpt: error: ")
    return lines[0]


@pytest.mark.parametrize("args,expected_code,says", [
    (["frobnicate"], 2, "No such command 'frobnicate'"),
    (["run", "--time-limit", "ten", "--", "true"], 2, "bad time-limit 'ten': use e.g. 90s"),
    (["run", "--grace", "-3s", "--", "true"], 2, "must not be negative"),
    (["run", "--time-limit", "10s", "--grace", "1m", "--", "true"], 2, "shorter than the time"),
    (["run", "--max-restarts", "x", "--", "true"], 2, "expected a whole number"),
    (["run", "--engine", "magic", "--", "true"], 2, "bad engine 'magic': choose one of auto"),
    (["run", "--config", "missing.yaml", "--", "true"], 2, "config file missing.yaml does not"),
    (["run"], 2, "Missing argument 'COMMAND...'"),
    (["run", "--", "no-such-binary-here"], 127, "command not found: no-such-binary-here"),
    (["status", "nowhere"], 2, "nowhere does not exist: give the checkpoint dir of a run"),
    (["report", "nowhere"], 2, "nowhere does not exist: give the checkpoint dir of a run"),
    (["status", "."], 2, "is not a procckpt checkpoint dir (no .procckpt marker)"),
])
def test_bad_input_gets_one_line(workdir: Path, args, expected_code, says):
    result = run([*procckpt_argv(), *args], cwd=workdir)
    assert result.returncode == expected_code
    assert says in one_line_error(result)


def test_unwritable_dir(workdir: Path):
    (workdir / "afile").write_text("")
    result = run([*procckpt_argv(), "run", "--dir", "afile/ckpt", "--", "true"], cwd=workdir)
    assert result.returncode == 2
    assert "cannot use checkpoint dir" in one_line_error(result)
    result = run([*procckpt_argv(), "run", "--dir", "/proc/ckpt", "--", "true"], cwd=workdir)
    assert result.returncode == 2
    assert "/proc/ckpt" in one_line_error(result)


def test_foreign_dir_is_left_alone(workdir: Path):
    own = workdir / "results"
    own.mkdir()
    (own / "model.pth").write_bytes(b"weights")
    result = run([*procckpt_argv(), "run", "--dir", "results", "--", "true"], cwd=workdir)
    assert result.returncode == 2
    assert "not a procckpt checkpoint dir (it holds model.pth)" in one_line_error(result)
    assert sorted(p.name for p in own.iterdir()) == ["model.pth"]


def test_status_shows_checkpoints_and_events(workdir: Path):
    from .conftest import PROGRAMS, PYTHON

    done = run([*procckpt_argv(), "run", "--dir", "c", "--", PYTHON,
                str(PROGRAMS / "tiny_train.py"), "--epochs", "1", "--save-every", "1"],
               cwd=workdir)
    assert done.returncode == 0, done.stderr
    status = run([*procckpt_argv(), "status", "c"], cwd=workdir)
    assert status.returncode == 0
    assert "finished" in status.stdout
    assert "ckpt-00000001  8     1" in status.stdout and "yes" in status.stdout
    assert "exit" in status.stdout and "reason=finished" in status.stdout


@pytest.mark.parametrize("argv", [
    ["run", "--dir", "ckpt", "--time-limit", "1m", "--", "sh", "-c", "exit 0"],
    ["sbatch", "--dry-run", "-t", "10:00", "--", "python", "train.py"],
    ["status", "ckpt"],
])
def test_the_launcher_side_never_imports_torch(tmp_path: Path, argv: list[str]):
    """procckpt run/sbatch/status are the launcher: importing torch would cost seconds and
    hundreds of MB on every login node and job; only the training script imports it."""
    from procckpt.store import CheckpointStore

    CheckpointStore(tmp_path / "ckpt").open()  # for status: a dir with something to show
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules, "
             "file=sys.__stderr__))\n"
             "from procckpt.cli import main\n"
             f"sys.exit(main({argv!r}))\n")
    result = subprocess.run([PYTHON, "-c", probe], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch imported: False" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("journal", [
    b"\x8b\x00garbage\xff\n" * 3,  # random bytes
    b'{"event": "start", "time": 1000.0, "job_id": nu\n',  # its launch line cut by a crash
])
def test_a_damaged_journal_is_said_with_how_many_lines_are_unreadable(workdir: Path,
                                                                      journal: bytes):
    ckpt = workdir / "ckpt"
    assert run([*procckpt_argv(), "run", "--dir", str(ckpt), "--", "true"],
               cwd=workdir).returncode == 0
    (ckpt / "events.jsonl").write_bytes(journal)
    lines = journal.count(b"\n")
    says = (f"{lines} line{'s' if lines > 1 else ''} of its journal (events.jsonl) "
            f"{'are' if lines > 1 else 'is'} unreadable (cut short by a crash, or damaged)")
    status = run([*procckpt_argv(), "status", str(ckpt)], cwd=workdir)
    assert status.returncode == 0 and f"journal:        {says}" in status.stdout, status.stdout
    report = run([*procckpt_argv(), "report", str(ckpt)], cwd=workdir)
    assert report.returncode == 0, report.stderr
    page = (ckpt / "report.html").read_text()
    assert says[0].upper() + says[1:] in page and "No launch in the journal yet" in page
