"""The package's layout keeps its promises: no import cycles between modules, no part imports a
part above it (inside training/ too), and every module says its job in its first line
(docs/architecture.md)."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "procckpt"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_at_module_level(path: Path) -> set[str]:
    """The procckpt modules ``path`` imports when it is imported (or type-checked): imports at
    module level and under ``if TYPE_CHECKING``, not the deferred ones inside functions."""
    nodes, body = [], list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If):
            body.extend(node.body)
        nodes.append(node)
    return _imported(path, nodes)


def _imported(path: Path, nodes: Iterable[ast.AST]) -> set[str]:
    """The procckpt modules that the import statements among ``nodes`` of ``path`` name."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                found.add(candidate if _is_module(candidate) else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("procckpt") and m != name}


def _is_module(dotted: str) -> bool:
    path = PACKAGE.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> the modules it imports)."""
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append(trail[trail.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [node])
        done.add(node)

    for start in sorted(graph):
        visit(start, [])
    return cycles


def test_no_module_imports_itself_through_others():
    cycles = cycles_in({module_name(p): imports_at_module_level(p)
                        for p in PACKAGE.rglob("*.py")})
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def all_imports(path: Path) -> set[str]:
    """The procckpt modules ``path`` imports anywhere: at module level and inside functions
    (a deferred import is still a dependency)."""
    return _imported(path, ast.walk(ast.parse(path.read_text())))


def test_no_cycle_even_through_imports_inside_functions():
    cycles = cycles_in({module_name(p): all_imports(p) for p in PACKAGE.rglob("*.py")})
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


#: What each part of the package may import, inside functions too (docs/architecture.md):
#: the store at the bottom, the protocol on it, the launcher and the schedulers on that, the
#: training side beside them (it asks schedulers/slurm for the first node's address, the one
#: Slurm read it makes), the readers of a checkpoint dir and the commands on top.
BASE = {"errors", "durations", "log"}
MAY_IMPORT = {
    "errors": set(), "durations": {"errors"}, "log": set(),
    "store": BASE,
    "protocol": BASE | {"store"},
    "launcher": BASE | {"store", "protocol"},
    "schedulers": BASE | {"store", "protocol", "launcher"},
    "training": BASE | {"store", "protocol", "schedulers"},
    "integrations": BASE | {"store", "protocol", "training"},
    "inspect": BASE | {"store", "protocol"},
    "check": BASE | {"store", "protocol", "launcher", "training"},
    "procckpt": BASE | {"training"},  # the package's __init__: the script's API
}


def test_no_part_imports_upward_even_inside_a_function():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        part = name.split(".")[1] if "." in name else "procckpt"
        if part in ("cli", "__main__"):
            continue  # the commands: on top of everything
        for target in all_imports(path):
            other = target.split(".")[1] if "." in target else "procckpt"
            if other != part and other not in MAY_IMPORT[part]:
                upward.append(f"{name} -> {target}")
    assert not upward, f"imports above their floor: {upward}"


#: The floors inside training/ (docs/architecture.md): where the training is and the link to
#: the launcher at the bottom, the write path on them, DCP as a format on that, process groups
#: on that, what a checkpoint holds and how it comes back on top; the Checkpointer and the
#: loops (the modules at training/'s top) may import all of them, none of them the top.
TRAINING_MAY_IMPORT = {
    "position": set(), "link": set(),
    "save": set(),
    "sharded": {"save"},
    "group": {"save", "sharded", "link", "position"},
    "state": {"save", "sharded", "group", "link", "position"},
}


def test_no_part_of_training_imports_a_part_above_it():
    upward = []
    for path in (PACKAGE / "training").rglob("*.py"):
        name = module_name(path)
        parts = name.split(".")
        if len(parts) < 4 and not (path.name == "__init__.py" and len(parts) == 3):
            continue  # training/'s own top: the front, free to use every part
        part = parts[2]
        if part not in TRAINING_MAY_IMPORT:
            continue
        for target in all_imports(path):
            tparts = target.split(".")
            if tparts[:2] != ["procckpt", "training"] or len(tparts) < 3:
                continue
            other = tparts[2] if tparts[2] in TRAINING_MAY_IMPORT else "(top)"
            if other != part and other not in TRAINING_MAY_IMPORT[part]:
                upward.append(f"{name} -> {target}")
    assert not upward, f"imports above their floor inside training/: {upward}"


def test_engines_and_deadlines_are_used_through_what_their_base_declares():
    """Every hook of an engine and every property of a deadline is declared on its base
    (launcher/engines/__init__.py, launcher/deadline.py): none is probed for."""
    probes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" \
                    and node.args and any(word in ast.unparse(node.args[0]).lower()
                                          for word in ("engine", "deadline")):
                probes.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not probes, f"getattr on an engine or a deadline: {probes}"


def test_every_module_says_its_job_first():
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].strip(), f"{path} has no one-line docstring"


def test_importing_procckpt_imports_no_framework():
    """The frameworks are optional: the Checkpointer works without Lightning, Transformers or
    Accelerate installed, so nothing but the user's own import of an integration loads them."""
    import subprocess
    import sys

    code = ("import sys, procckpt; procckpt.Checkpointer; import procckpt.cli; "
            "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', "
            "'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


#: The last commit before subjects were held to 72 characters (shared/STYLE.md); older ones
#: stay as they were written.
SHORT_SUBJECTS_SINCE = "a916231d51f07de0b9854ddb6a3c39d0089f1811"


def test_commit_subjects_are_at_most_72_characters():
    import subprocess

    repo = PACKAGE.parent.parent
    log = subprocess.run(["git", "log", "--format=%s", f"{SHORT_SUBJECTS_SINCE}..HEAD"],
                         cwd=repo, capture_output=True, text=True)
    if log.returncode != 0:
        pytest.skip(f"no history to read here (a shallow clone, or no git): {log.stderr[:200]}")
    long = [s for s in log.stdout.splitlines() if len(s) > 72]
    assert not long, f"commit subjects over 72 characters (the why goes in the body): {long}"
