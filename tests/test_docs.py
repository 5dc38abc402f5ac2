"""The docs keep their promises: every page is reachable from docs/index.md, every link leads
somewhere, and every `procckpt` command line they show names a command and options the CLI
has (README.md, docs/, tests/README.md)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from procckpt.cli import cli

from .conftest import REPO

#: Unit tests: fast, no `procckpt run` of their own (`make unit`; tests/README.md).
pytestmark = pytest.mark.unit

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", REPO / "tests" / "README.md", REPO / "benchmarks" / "README.md",
         REPO / "examples" / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: Commands whose unknown options are not errors: sbatch hands them to Slurm.
PASS_THROUGH = {"sbatch"}


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text())
            if not target.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_leads_to_a_file(page: Path):
    missing = [t for t in links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to what is not there: {missing}"


def test_every_docs_page_is_reachable_from_the_index():
    linked = {(DOCS / t).resolve() for t in links(DOCS / "index.md")}
    unreachable = [p.name for p in DOCS.glob("*.md") if p.name != "index.md"
                   and p.resolve() not in linked]
    assert not unreachable, f"docs/index.md does not link to {unreachable}"
    assert "docs/index.md" in (REPO / "README.md").read_text()


def command_lines(page: Path) -> list[str]:
    """The ``procckpt ...`` command lines a page shows: in shell blocks (a prompt, ``exec`` or
    ``srun`` before it allowed) and in code spans that start with it."""
    text = page.read_text()
    found = []
    for block in re.findall(r"```(?:sh|bash|shell|console)\n(.*?)```", text, flags=re.S):
        found += [re.sub(r"^(\$ |exec |srun )", "", line.split(" #")[0].strip())
                  for line in block.splitlines()]
    found += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [line for line in found if line.startswith("procckpt ")]


def known_options(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)
            if opt.startswith("-")} | {"--help", "-h"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_line_shown_is_one_the_cli_knows(page: Path):
    unknown = []
    for line in command_lines(page):
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        if len(words) < 2 or not re.fullmatch(r"[a-z][a-z0-9-]*", words[1]):
            continue  # "procckpt" alone in prose, or a placeholder
        command = cli.commands.get(words[1])
        if command is None:
            unknown.append(f"{line!r}: no command {words[1]!r}")
            continue
        if words[1] in PASS_THROUGH:
            continue
        options = known_options(command)
        for word in words[2:]:
            if word == "--":
                break  # the user's command follows
            name = word.split("=", 1)[0]
            if name.startswith("-") and name not in options and not name[1:].isdigit():
                unknown.append(f"{line!r}: {words[1]} has no option {name}")
    assert not unknown, f"{page.relative_to(REPO)}: " + "; ".join(unknown)


def test_every_environment_variable_the_code_reads_is_in_the_reference():
    source = "\n".join(p.read_text() for p in (REPO / "src" / "procckpt").rglob("*.py"))
    variables = set(re.findall(r"[\"'](PROCCKPT_[A-Z0-9_]+)[\"']", source))
    reference = (DOCS / "cli.md").read_text()
    missing = sorted(v for v in variables if f"`{v}`" not in reference)
    assert variables and not missing, f"docs/cli.md does not name {missing}"


def test_the_checks_help_names_the_exit_codes_of_the_one_table():
    """docs/cli.md's exit-code table has a column for ``procckpt check``; its --help names
    the same codes."""
    codes = []
    for line in (DOCS / "cli.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit() and cells[3]:
            codes.append(int(cells[0]))
    help_text = " ".join((cli.commands["check"].help or "").split())
    said = [int(c) for c in re.findall(r"(\d+) [a-z]", help_text.split("Exit:", 1)[1])]
    assert codes and said == codes, (said, codes)


def test_the_run_option_table_in_the_reference_is_the_codes():
    from procckpt.launcher.config import OPTIONS, shown_default

    rows = {}
    for line in (DOCS / "cli.md").read_text().splitlines():
        first = re.match(r"\| `(--[a-z-]+)", line)
        if first:
            rows.setdefault(first.group(1), line)
    wrong = []
    for option in OPTIONS.values():
        row = rows.get(option.flag)
        if row is None:
            wrong.append(f"{option.flag}: no row")
        elif f"default: {shown_default(option)}" not in row:
            wrong.append(f"{option.flag}: says no 'default: {shown_default(option)}'")
    shown = [flag for flag in rows if flag not in {o.flag for o in OPTIONS.values()}
             and flag != "--config" and not _in_other_tables(flag)]
    assert not wrong and not shown, f"docs/cli.md: {wrong} {shown}"


def _in_other_tables(flag: str) -> bool:
    """An option of another command (its own tables in the same page)."""
    return any(flag in known_options(command) for name, command in cli.commands.items()
               if name != "run")
