"""Warm restarts: a spare interpreter that has already imported torch waits beside the training,
and a restart runs the script in it instead of starting Python and torch again.

    procckpt run -> keeper -> python -c BOOTSTRAP   (imports torch, then waits on a pipe)

A cold start of ``python train.py`` spends seconds before the script's first line of its own:
the interpreter, ``import torch``, and ``torch._dynamo``, which the first optimizer imports.
Once a cycle's training has reached its first step (its own start-up no longer competes for
the processors), the launcher starts one spare behind a keeper of its own, as a command is
started: a session and process group of its own, the keeper's lifeline, the environment of a
cold start. The spare's bootstrap puts the script's directory first on ``sys.path`` (as
``python train.py`` would, so that the same modules are found), imports torch, and waits on
its pipe; meanwhile, once the memory tier holds a slot, it touches memory of the slot's size
for the restore's copies (training/state/reserve.py). The restart sends the cycle's argv,
environment and working directory. The bootstrap sets them (``sys.argv``, ``sys.orig_argv``,
``os.environ``) and runs the script as ``__main__`` with :mod:`runpy`, as ``python`` runs a
script or ``-m`` a module. A run that ends without using its spare closes the pipe: the
bootstrap exits at once, and the keeper goes with the lifeline.

Only ``python [-u|-O|-B|-W arg|-X opt...] script.py ...`` and ``python ... -m module ...``
are served, under the hooks engine, by a launcher alone on its node. torchrun (a launcher of
its own, and its ranks), shells and DMTCP (which wraps the command) start cold, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from ..protocol import control as ctl
from ..store.cgroups import memory_short
from ..store.files import format_size
from .child import Child, start_behind_keeper

__all__ = ["BOOTSTRAP", "WarmRestarts", "warm_restarts", "warm_target"]

logger = logging.getLogger(__name__)

#: Set for each cycle by the launcher (supervisor.py): a spare gets them with the cycle.
_PER_CYCLE = frozenset({ctl.ENV_TOKEN, ctl.ENV_RESTART, ctl.ENV_CYCLE, ctl.ENV_RECOVERY})

#: Run by the spare: ``python [flags] -c BOOTSTRAP FD PATH0``. Standard library only until
#: torch, which it imports as the script would (and what the first optimizer step imports).
#: Then procckpt's training side rehearses a restore in miniature, so that the first calls of
#: a restore are paid (training/state/rehearsal.py), and while it waits touches memory for the
#: restore's copies (training/state/reserve.py).
#:
#: The imports and the rehearsal run with the spare's autogroup at nice 19, and the nice it
#: had is put back before the spare waits (no privilege needed: a nice of 0 or more). Where
#: the kernel groups processes by session for the scheduler (``sched_autogroup_enabled``,
#: for processes outside a cgroup with a CPU controller), the spare, in a session of its own,
#: weighed as much as the training's whole session: beside a training whose OpenMP threads
#: wait for each other at every parallel region, the import left them one core of two for
#: 2-3 s, and the training's steps took 3.5x as long (BENCHMARKS.md, session 55). A nice
#: that cannot be put back ends the spare: the restart then starts cold.
BOOTSTRAP = """\
import os, sys
_fd, sys.path[0] = int(sys.argv[1]), sys.argv[2]
_nice = None
try:
    with open("/proc/self/autogroup") as _f:
        _had = int(_f.read().split()[-1])
    with open("/proc/self/autogroup", "w") as _f:
        _f.write("19")
    _nice = _had  # (only once lowered: one that was never lowered is not put back)
    del _had
except (OSError, ValueError, IndexError):
    pass
try:
    import torch, torch.optim
    try:
        import torch._dynamo
    except Exception:
        pass
except Exception:
    pass
try:
    from procckpt.training.state.rehearsal import rehearse
    rehearse()
    del rehearse
except Exception:
    pass
if _nice is not None:
    try:
        with open("/proc/self/autogroup", "w") as _f:
            _f.write(str(_nice))
    except OSError:
        os._exit(1)
    del _f
del _nice
try:
    from procckpt.training.state.reserve import wait_readable
    wait_readable(_fd)
    del wait_readable
except Exception:
    pass
_chunks = []
while True:
    _chunk = os.read(_fd, 1 << 16)
    if not _chunk:
        break
    _chunks.append(_chunk)
os.close(_fd)
if not _chunks:
    os._exit(0)
import json, runpy
_go = json.loads(b"".join(_chunks))
os.environ.clear()
os.environ.update(_go["env"])
os.chdir(_go["cwd"])
sys.argv, sys.orig_argv = list(_go["argv"]), list(_go["orig_argv"])
del _fd, _chunks, _chunk
if _go["module"] is not None:
    runpy.run_module(_go["module"], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(_go["script"], run_name="__main__")
"""

#: Interpreter options a spare takes as they are: they change nothing the bootstrap does.
_PLAIN_FLAGS = re.compile(r"-[uOBbdEqsv]+$")
_FLAGS_WITH_VALUE = ("-W", "-X")
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?$")


class Target:
    """What a command runs, as a spare needs it: the interpreter with its options, the path
    that comes first on ``sys.path``, and the script or module with its arguments."""

    def __init__(self, interpreter: list[str], script: str | None, module: str | None,
                 args: list[str]) -> None:
        self.interpreter, self.script, self.module, self.args = interpreter, script, module, args

    def path0(self, cwd: str) -> str:
        if self.script is not None:
            return os.path.dirname(os.path.realpath(os.path.join(cwd, self.script)))
        return cwd

    def argv(self) -> list[str]:
        if self.script is not None:
            return [self.script, *self.args]
        # As `python -m` sets it: the module's file (runpy replaces it while it runs).
        return ["-m", *self.args]

    def orig_argv(self) -> list[str]:
        """The command line, as a cold start's ``sys.orig_argv`` holds it."""
        run = [self.script] if self.script is not None else ["-m", str(self.module)]
        return [*self.interpreter, *run, *self.args]


def warm_target(command: Sequence[str]) -> Target | str:
    """The command as a spare would run it, or why none can."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return "the command is not `python script.py` or `python -m module`"
    interpreter, i = [command[0]], 1
    while i < len(command) and command[i].startswith("-") and command[i] != "-m":
        option = command[i]
        if _PLAIN_FLAGS.match(option):
            interpreter.append(option)
        elif option in _FLAGS_WITH_VALUE and i + 1 < len(command):
            interpreter += [option, command[i + 1]]
            i += 1
        elif option[:2] in _FLAGS_WITH_VALUE and len(option) > 2:
            interpreter.append(option)
        else:
            return f"Python's option {option} is not one a spare interpreter can take"
        i += 1
    if i >= len(command):
        return "the command runs no script"
    if command[i] == "-m":
        if i + 1 >= len(command):
            return "the command runs no module"
        module = command[i + 1]
        if module.startswith("torch.distributed"):
            return "torchrun starts its ranks itself"
        return Target(interpreter, None, module, list(command[i + 2:]))
    return Target(interpreter, command[i], None, list(command[i + 1:]))


class Spare:
    """One spare interpreter behind its keeper, waiting for :meth:`go`."""

    def __init__(self, target: Target, env: Mapping[str, str], cwd: str) -> None:
        go_r, self._go = os.pipe()
        try:
            self.popen, self.lifeline = start_behind_keeper(
                [*target.interpreter, "-c", BOOTSTRAP, str(go_r), target.path0(cwd)], env,
                pass_fds=(go_r,), cwd=cwd)
        except BaseException:
            os.close(self._go)
            raise
        finally:
            os.close(go_r)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def go(self, target: Target, env: Mapping[str, str], cwd: str) -> None:
        message = {"env": dict(env), "cwd": cwd, "argv": target.argv(),
                   "orig_argv": target.orig_argv(), "module": target.module,
                   "script": target.script}
        data = json.dumps(message).encode()
        try:
            while data:
                data = data[os.write(self._go, data):]
        finally:
            os.close(self._go)
            self._go = -1

    def close(self) -> None:
        """End an unused spare: its bootstrap reads the pipe's end and exits; its keeper's
        lifeline ends too, which kills whatever is left."""
        for fd in (self._go, self.lifeline):
            if fd >= 0:
                os.close(fd)
        self._go = self.lifeline = -1
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class WarmChild(Child):
    """A cycle's command run in a spare: started by handing it the cycle, not by exec."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], spare: Spare,
                 target: Target) -> None:
        super().__init__(argv, env)
        self._spare, self._target = spare, target
        #: Whether the cycle runs in the spare (False once it fell back to a cold start).
        self.warm = False

    def start(self) -> None:
        spare = self._spare
        try:
            spare.go(self._target, self.env, os.getcwd())
        except OSError as e:  # it died since it was last seen alive
            logger.warning("warm restarts: the spare interpreter could not take the cycle "
                           "(%s); it starts cold", e.strerror or e)
            spare.close()
            super().start()
            return
        self._popen, self._lifeline = spare.popen, spare.lifeline
        spare.lifeline = -1  # the child's now: it closes it once the keeper exited
        self.warm = True


class WarmRestarts:
    """The launcher's spare, started during a cycle once the training stepped, used by the
    next cycle. One per run at most; a spare that died is replaced by a cold start."""

    def __init__(self, target: Target, now: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self._spare: Spare | None = None
        self._now = now
        self._look_again = float("-inf")
        self._said_no_room = False

    def prepare(self, env: Mapping[str, str]) -> None:
        """Start the spare for the next restart, if there is none and there is room for it."""
        if self._spare is not None or self._now() < self._look_again:
            return
        short = _no_room()
        if short is not None:
            if not self._said_no_room:
                logger.info("warm restarts: no spare interpreter for now: %s; a restart "
                            "starts a new interpreter", short)
                self._said_no_room = True
            self._look_again = self._now() + _ROOM_LOOKS
            return
        spare_env = {k: v for k, v in env.items() if k not in _PER_CYCLE}
        try:
            self._spare = Spare(self.target, spare_env, os.getcwd())
        except OSError as e:
            logger.warning("warm restarts: could not start a spare interpreter (%s); "
                           "restarts start cold", e.strerror or e)
            return
        logger.info("warm restarts: a spare interpreter (pid %d) imports torch now, for a "
                    "restart to start from", self._spare.pid)

    def take(self, argv: Sequence[str], env: Mapping[str, str]) -> WarmChild | None:
        """A child to start in the spare, or None (no spare, or it died): a cold start."""
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if not spare.alive():
            logger.warning("warm restarts: the spare interpreter exited (code %s); this "
                           "restart starts cold", spare.popen.returncode)
            spare.close()
            return None
        return WarmChild(argv, env, spare, self.target)

    def close(self) -> None:
        if self._spare is not None:
            self._spare.close()
            self._spare = None


#: What a spare takes (an interpreter with torch imported: about 300 MB resident), with a
#: margin: it is started only where the machine and every cgroup limit leave this much.
SPARE_ROOM = 768 << 20
#: After a look that found no room, the next one comes this many seconds later.
_ROOM_LOOKS = 30.0


def _no_room() -> str | None:
    """Why there is no room for a spare now, or None if there is."""
    short = memory_short(SPARE_ROOM)
    return None if short is None else \
        f"{short}, a spare needs about {format_size(SPARE_ROOM)} with a margin"


def _a_rank(env: Mapping[str, str]) -> bool:
    """Whether the command is one rank of a group, as the training sees it (group/setup.py)."""
    try:
        if int(env.get("WORLD_SIZE") or 1) > 1:
            return True
        return "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS")
                                             or env.get("SLURM_NPROCS") or 1) > 1
    except ValueError:
        return False


@contextlib.contextmanager
def warm_restarts(enabled: bool, engine: str, command: Sequence[str],
                  alone: bool) -> Iterator[WarmRestarts | None]:
    """The run's warm restarts while it lasts (None where there are none: said once why)."""
    target = warm_target(command)
    why: str | None = None
    if engine != "hooks":
        why = f"not with the {engine} engine (it starts the command itself)"
    elif not alone:
        why = "not for a run on several nodes"
    elif _a_rank(os.environ):
        why = "not for a rank of a group (srun's tasks, WORLD_SIZE above 1)"
    elif isinstance(target, str):
        why = f"not for this command: {target}"
    if not enabled or isinstance(target, str) or why is not None:
        if enabled:
            logger.info("warm restarts: %s; a restart starts a new interpreter", why)
        yield None
        return
    warm = WarmRestarts(target)
    try:
        yield warm
    finally:
        warm.close()
