"""Which engine runs a command: ``--engine auto`` decided, with the reason ``procckpt run`` logs.

The rule of ``auto``, first match wins:

1. the checkpoint dir already holds checkpoints: the engine that wrote the newest one (a run
   must not switch engines halfway and start again from scratch);
2. the command's script imports procckpt (``import procckpt`` / ``from procckpt``): hooks;
3. CUDA devices are visible: hooks (neither CRIU nor DMTCP images a process that uses CUDA);
4. CRIU passes its checks (4.1 or newer, root, ``criu check``) and the command is not a
   launcher of ranks that talk over TCP (torchrun, srun, mpirun, ...: CRIU images one
   tree without its connections): CRIU, which images DataLoader workers too;
5. DMTCP is not installed (no ``dmtcp_launch`` on PATH): hooks;
6. a test launch under DMTCP fails: hooks;
7. otherwise DMTCP: the command knows nothing of procckpt and DMTCP can image it.

The script is the first ``*.py`` argument, the module of ``-m``, or the code of ``-c``. A
shell given its commands inline (``sh -c 'cd run && python train.py'``, also ``bash -lc``)
is read the same way: every simple command of its string counts. A script that reaches
procckpt through a module of its own (``from mingpt.trainer import Trainer``, a file beside it
or under the working directory) counts too: those modules are read, and theirs in turn. One
that reaches it only through an installed package, or a shell script file, is not seen: name
the engine (``--engine hooks``) in that case.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError
from ...store import CheckpointStore
from .criu import CriuProblem, CriuTools, criu_usable, find_criu
from .dmtcp import DmtcpTools, find_dmtcp, missing_dmtcp_message
from .dmtcp.engine import fork_safe_env

__all__ = ["EngineChoice", "choose_engine", "cuda_visible", "imports_procckpt"]

logger = logging.getLogger(__name__)

_IMPORT_RE = re.compile(r"^\s*(?:import\s+(?:[\w.]+(?:\s+as\s+\w+)?\s*,\s*)*procckpt\b"
                        r"|from\s+procckpt(?:\.\w+)*\s+import\b)", re.MULTILINE)
_SCRIPT_LIMIT = 4 << 20
#: Seconds the DMTCP probe may take (a hung fork never ends by itself).
PROBE_TIMEOUT = 30.0
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
#: Tokens of a shell string (as shlex splits it) after which another command starts, or the
#: real program of this one (exec, time, env, nohup run the words that follow).
_SHELL_SEPARATORS = frozenset({";", "&&", "||", "|", "&", "(", ")", "{", "}", "!", "then",
                               "do", "else", "elif", "exec", "time", "env", "nohup"})


@dataclass(frozen=True)
class EngineChoice:
    name: str  # "hooks", "dmtcp" or "criu"
    reason: str
    tools: DmtcpTools | CriuTools | None = None
    #: Said at the start when the command, as far as can be seen, cannot be checkpointed.
    warning: str | None = None


def choose_engine(requested: str, command: list[str], store: CheckpointStore, *,
                  environ: Mapping[str, str] | None = None, cwd: Path | None = None,
                  find: Callable[[], DmtcpTools | None] = find_dmtcp,
                  probe: Callable[[DmtcpTools], str | None] | None = None,
                  criu: Callable[[], tuple[CriuTools | None, CriuProblem | None]] | None = None,
                  dev: Path = Path("/dev")) -> EngineChoice:
    """Decide the engine for ``command``; see the module docstring for the ``auto`` rule.

    Raises:
        UsageError: ``--engine dmtcp`` without DMTCP installed, or checkpoints in the dir that
            the chosen engine cannot resume.
    """
    environ = os.environ if environ is None else environ
    probe = probe or probe_dmtcp
    criu = criu or (lambda: criu_usable(find_criu()))
    written_by = _newest_engine(store)
    if requested == "hooks":
        if written_by in ("dmtcp", "criu"):
            raise UsageError(f"{store.root} holds {written_by.upper()} images, which the hooks "
                             f"engine cannot resume: run with --engine {written_by}, or use a "
                             "new --dir")
        return EngineChoice("hooks", "--engine hooks")
    if requested == "criu" or (requested == "auto" and written_by == "criu"):
        chosen = _criu_choice(requested, written_by, store, criu)
        _warn_of_gpus(environ, dev, "CRIU cannot image a process that uses CUDA (procckpt "
                                    "does not drive cuda-checkpoint yet)")
        return chosen
    if requested == "dmtcp":
        tools = find()
        if tools is None:
            raise UsageError(missing_dmtcp_message("--engine dmtcp needs DMTCP"))
        _warn_of_gpus(environ, dev, "DMTCP cannot checkpoint a process that uses CUDA")
        return EngineChoice("dmtcp", "--engine dmtcp", tools)

    if written_by == "dmtcp":
        tools = find()
        if tools is None:
            raise UsageError(missing_dmtcp_message(f"the checkpoints in {store.root} are DMTCP "
                                                   "images"))
        return EngineChoice("dmtcp", "the checkpoint dir holds DMTCP images", tools)
    if written_by is not None:
        return EngineChoice(written_by, f"the checkpoint dir holds {written_by} checkpoints")
    read: list[str] = []
    script = imports_procckpt(command, cwd or Path.cwd(), read=read)
    if script is not None:
        return EngineChoice("hooks", f"{script} imports procckpt")
    gpu = cuda_visible(environ, dev)
    if gpu:
        why = f"{gpu}, and neither CRIU nor DMTCP can image a process that uses CUDA"
        return EngineChoice("hooks", f"{why}; the command must use procckpt.Checkpointer to be "
                                     "checkpointed", warning=_unsaveable(read, why))
    criu_tools, not_criu = _criu_for_auto(command, criu)
    if criu_tools is not None:
        return EngineChoice("criu", "the command does not import procckpt and CRIU "
                                    f"{criu_tools.version_text} can image it", criu_tools)
    tools = find()
    if tools is None:
        why = f"DMTCP is not installed (no dmtcp_launch on PATH), {not_criu}"
        return EngineChoice("hooks", f"{why}; the command must use procckpt.Checkpointer to "
                                     "be checkpointed", warning=_unsaveable(read, why))
    problem_dmtcp = probe(tools)
    if problem_dmtcp is not None:
        return EngineChoice("hooks", f"DMTCP is installed but {problem_dmtcp}; {not_criu}",
                            warning=_unsaveable(read, f"DMTCP {problem_dmtcp}"))
    return EngineChoice("dmtcp", "the command does not import procckpt and DMTCP is installed "
                                 f"({not_criu})", tools)


def _criu_for_auto(command: list[str],
                   criu: Callable[[], tuple[CriuTools | None, CriuProblem | None]],
                   ) -> tuple[CriuTools | None, str]:
    """CRIU's tools when ``auto`` may give it ``command``, else why not (``not CRIU: ...``)."""
    ranks = _rank_launcher(command)
    if ranks is not None:
        return None, (f"not CRIU: {ranks} starts ranks that talk over TCP, which a CRIU image "
                      "does not hold")
    tools, problem = criu()
    if problem is not None:
        return None, f"not CRIU: {problem.why}"
    return tools, ""


#: Programs (and ``python -m`` modules) that start ranks talking to each other over TCP.
_RANK_LAUNCHERS = frozenset({"torchrun", "srun", "mpirun", "mpiexec", "accelerate",
                             "deepspeed", "torch.distributed.run", "torch.distributed.launch"})


def _rank_launcher(command: list[str]) -> str | None:
    """The launcher of ranks ``command`` runs (itself, ``python -m`` it, or a simple command
    of its inline shell string), else None."""
    inline = _shell_code(command)
    if inline is not None:
        return next(filter(None, map(_rank_launcher, _shell_commands(inline))), None)
    if not command:
        return None
    name = os.path.basename(command[0])
    if name in _RANK_LAUNCHERS:
        return name
    args = command[1:]
    if name.startswith("python") and "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        if module in _RANK_LAUNCHERS:
            return f"python -m {module}"
    return None


def _criu_choice(requested: str, written_by: str | None, store: CheckpointStore,
                 criu: Callable[[], tuple[CriuTools | None, CriuProblem | None]],
                 ) -> EngineChoice:
    """``--engine criu``, or ``auto`` on a dir of CRIU images: CRIU, or one line why not."""
    if written_by not in (None, "criu"):
        raise UsageError(f"{store.root} holds {written_by} checkpoints, which the CRIU engine "
                         f"cannot resume: run with --engine {written_by}, or use a new --dir")
    tools, problem = criu()
    if problem is not None:
        raise UsageError(problem.message if requested == "criu" else
                         f"the checkpoints in {store.root} are CRIU images, but "
                         f"{problem.message}")
    assert tools is not None
    return EngineChoice("criu", "--engine criu" if requested == "criu" else
                        "the checkpoint dir holds CRIU images", tools)


def _warn_of_gpus(environ: Mapping[str, str], dev: Path, cannot: str) -> None:
    """Where CUDA devices are visible to an image engine that ``cannot`` image them."""
    gpu = cuda_visible(environ, dev)
    if gpu:
        logger.warning("%s, and %s: if the command uses the GPU, run it with --engine hooks",
                       gpu, cannot)


def _unsaveable(read: list[str], why: str) -> str | None:
    """The warning for a command whose script was read and does not use procckpt."""
    if not read:
        return None  # nothing was seen (a shell script file): it may well use procckpt
    return (f"{read[0]} does not import procckpt and {why}: procckpt can stop and restart it "
            "but cannot save its progress, so a stop loses everything since it started "
            "(use procckpt.Checkpointer in the script, or install CRIU or DMTCP)")


def _newest_engine(store: CheckpointStore) -> str | None:
    infos = store.checkpoints()
    if not infos:
        return None
    engine = infos[0].manifest.get("engine")
    return str(engine) if engine in ("hooks", "dmtcp", "criu") else None


def imports_procckpt(command: list[str], cwd: Path, read: list[str] | None = None,
                     ) -> str | None:
    """The script of ``command`` if its source imports procckpt, else None. The names of the
    sources that were read are appended to ``read``."""
    inline = _shell_code(command)
    if inline is not None:
        for simple in _shell_commands(inline):
            if simple[0] == "cd" and len(simple) == 2:  # cd run && python train.py
                cwd = cwd / os.path.expanduser(simple[1])
                continue
            found = imports_procckpt(simple, cwd, read)
            if found is not None:
                return found
        return None
    args = command[1:] if command else []
    if "-m" in args[:-1]:
        module = args[args.index("-m") + 1]
        if module == "procckpt" or module.startswith("procckpt."):
            return module  # procckpt's own modules import it relatively, not by name
    for source_name, text in _sources(command, cwd):
        if _IMPORT_RE.search(text):
            return source_name
        through = _through_own_modules(text, _source_dir(source_name, cwd), cwd)
        if through is not None:
            return f"{source_name} (through {through})"
        if read is not None:
            read.append(source_name)
    return None


#: How many of a script's own modules are read, at most, looking for an import of procckpt.
_OWN_MODULES = 64


def _source_dir(source_name: str, cwd: Path) -> Path:
    path = Path(source_name)
    return (path if path.is_absolute() else cwd / path).parent


def _through_own_modules(text: str, script_dir: Path, cwd: Path) -> str | None:
    """The first of the script's own modules (files beside it or under the working directory,
    not installed packages) that imports procckpt, following their imports in turn, as a path
    relative to where it was found; None when none does."""
    roots = list(dict.fromkeys([script_dir.resolve(), cwd.resolve()]))
    queue: list[tuple[str, Path]] = [(text, roots[0])]
    seen: set[Path] = set()
    while queue and len(seen) < _OWN_MODULES:
        source, package = queue.pop(0)
        for path in _imported_files(source, package, roots):
            if path in seen:
                continue
            seen.add(path)
            module = _read(path)
            if module is None:
                continue
            if _IMPORT_RE.search(module):
                root = next((r for r in roots if path.is_relative_to(r)), path.parent)
                return str(path.relative_to(root))
            queue.append((module, path.parent))
    return None


def _imported_files(source: str, package: Path, roots: list[Path]) -> list[Path]:
    """The files of the modules ``source`` imports that exist under ``roots`` (relative
    imports: under ``package``, the importing module's folder)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    names: list[tuple[Path, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((root, alias.name) for alias in node.names for root in roots)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                bases = [base]
            else:
                bases = roots
            module = node.module or ""
            for base in bases:
                names.append((base, module))
                names.extend((base, f"{module}.{a.name}" if module else a.name)
                             for a in node.names)
    found = []
    for base, dotted in names:
        if not dotted:
            continue
        target = base.joinpath(*dotted.split("."))
        for candidate in (target.with_suffix(".py"), target / "__init__.py"):
            if candidate.is_file():
                found.append(candidate.resolve())
                break
    return found


def _shell_code(command: list[str]) -> str | None:
    """The command string of ``sh -c STRING ...`` (any of the usual shells), else None."""
    if not command or os.path.basename(command[0]) not in _SHELLS:
        return None
    i = 1
    while i < len(command) - 1:
        arg = command[i]
        if arg == "--" or arg[:1] not in "-+":
            return None  # the end of the options, or a script file: sh run.sh
        if arg in ("-o", "+o", "-O", "+O"):
            i += 2  # bash -o pipefail -c ...
            continue
        if arg[0] == "-" and not arg.startswith("--") and "c" in arg[1:]:
            return command[i + 1]  # -c, -lc, -ec, -xec ...
        i += 1  # --login, --norc, -e, +x ...
    return None


def _shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell string, as argument lists (best effort: no expansion)."""
    try:
        lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the shell itself would refuse it
        return []
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token in _SHELL_SEPARATORS or (token and set(token) <= set(";&|()")):
            commands.append([])
        elif not commands[-1] and "=" in token and not token.startswith("="):
            continue  # VAR=value before the command
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


#: Modules that launch a training script named after them (``python -m torch.distributed.run
#: --nproc-per-node 2 train.py``): the script is read, not the launcher.
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _sources(command: list[str], cwd: Path) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    args = command[1:] if command else []
    for i, arg in enumerate(args):
        if arg == "-c" and i + 1 < len(args):
            found.append(("the -c code", args[i + 1]))
            break
        if arg == "-m" and i + 1 < len(args):
            if args[i + 1] in _LAUNCHER_MODULES:
                continue  # torchrun's own module: the training script comes after it
            base = cwd / args[i + 1].replace(".", "/")
            for candidate in (base.with_suffix(".py"), base / "__main__.py"):
                text = _read(candidate)
                if text is not None:
                    found.append((str(candidate), text))
                    break
            break
        if arg.endswith(".py"):
            path = Path(arg) if os.path.isabs(arg) else cwd / arg
            text = _read(path)
            if text is not None:
                found.append((arg, text))
                break
    if command and command[0].endswith(".py"):  # ./train.py run directly
        text = _read(cwd / command[0])
        if text is not None:
            found.append((command[0], text))
    return found


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(_SCRIPT_LIMIT).decode("utf-8", errors="replace")
    except OSError:
        return None


def cuda_visible(environ: Mapping[str, str], dev: Path = Path("/dev")) -> str | None:
    """Why CUDA devices look usable by the command, or None."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        if visible.strip() in ("", "-1", "NoDevFiles"):
            return None
        return f"CUDA_VISIBLE_DEVICES={visible}"
    gpus = sorted(dev.glob("nvidia[0-9]*"))
    if gpus:
        return f"{len(gpus)} NVIDIA device(s) in {dev}"
    return None


#: What a training script does that DMTCP must survive: threads running (NumPy's BLAS pool
#: among them, when NumPy is there), then a fork and exec (a subprocess, a DataLoader worker).
_PROBE = """
import subprocess, threading, time
try:
    import numpy
except ImportError:
    pass
threading.Thread(target=time.sleep, args=(1,), daemon=True).start()
subprocess.run(["true"], check=True)
"""


def probe_dmtcp(tools: DmtcpTools) -> str | None:
    """Run a Python that forks under threads, under DMTCP with a private coordinator and the
    environment the engine gives commands; why that failed, or None. A crash is tried once
    more (a child of the test crashed under DMTCP once in hundreds of launches on a loaded
    machine: one crash must not decide the engine of a whole run); a hang is not."""
    problem = _probe_once(tools)
    if problem is None or "did not finish" in problem:
        return problem
    again = _probe_once(tools)
    if again is None:
        logger.warning("%s; a second one passed: DMTCP is used", problem)
    return again


def _probe_once(tools: DmtcpTools) -> str | None:
    with tempfile.TemporaryDirectory(prefix="procckpt-dmtcp-probe-") as tmp:
        argv = [tools.launch, "--new-coordinator", "--coord-port", "0", "--port-file",
                str(Path(tmp) / "port"), "--ckptdir", tmp, "-q", "-q", sys.executable, "-c",
                _PROBE]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DMTCP_")}
        env.update(fork_safe_env(env))
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True, env=env, start_new_session=True)
        except OSError as e:
            return f"dmtcp_launch cannot be run ({e.strerror})"
        try:
            _, stderr = proc.communicate(timeout=PROBE_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its coordinator too: same session
            proc.communicate()
            return (f"a test program that forks under threads did not finish under DMTCP in "
                    f"{PROBE_TIMEOUT:.0f}s")
    if proc.returncode != 0:
        last = (stderr.strip().splitlines() or ["no message"])[-1]
        return f"a test launch under dmtcp_launch failed (exit {proc.returncode}: {last[:200]})"
    return None
