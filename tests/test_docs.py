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
#: Every Markdown page of the repository but generated ones (BENCHMARKS.md, written by `make
#: bench`) and what lies in hidden or build folders.
PAGES = sorted(p for p in REPO.rglob("*.md")
               if not any(part.startswith(".") or part.endswith(".egg-info") or part == "build"
                          for part in p.relative_to(REPO).parts[:-1])
               and p.name != "BENCHMARKS.md")
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


def test_each_run_option_row_names_every_flag_of_the_option_and_its_value():
    """A row shows the option as --help does: both halves of an on/off switch, the metavar."""
    from procckpt.launcher.config import OPTIONS

    firsts = {}
    for line in (DOCS / "cli.md").read_text().splitlines():
        first = re.match(r"\| `(--[a-z-]+)[^|]*?(?:\\\|[^|]*?)*\|", line)
        if first:
            firsts.setdefault(first.group(1), first.group(0))
    run_params = {p.name: p for p in cli.commands["run"].params}
    wrong = []
    for option in OPTIONS.values():
        param, cell = run_params[option.name], firsts.get(option.flag, "")
        for flag in (*param.opts, *param.secondary_opts):
            if f"`{flag}" not in cell:
                wrong.append(f"{option.flag}: its row does not show {flag}")
        metavar = param.metavar
        if metavar and metavar.replace("|", "\\|") not in cell:
            wrong.append(f"{option.flag}: its row does not show {metavar}")
    assert not wrong, wrong


def test_one_exit_code_table_in_all_the_pages():
    tables = [str(p.relative_to(REPO)) for p in PAGES
              if re.search(r"^\| code \|", p.read_text(), flags=re.M)]
    assert tables == ["docs/cli.md"], f"exit-code tables in {tables}: keep the one in cli.md"


def test_an_array_tasks_requeue_id_is_spelled_one_way():
    """``<array job id>_<task id>``, never a made-up variable name (three drifted before)."""
    texts = [p.read_text() for p in PAGES] + [
        p.read_text() for p in (REPO / "src" / "procckpt").rglob("*.py")]
    invented = sorted({m for text in texts
                       for m in re.findall(r"(?<![A-Z_])ARRAY[A-Z]*_TASK[A-Z]*", text)})
    assert not invented, invented
    assert "`<array job id>_<task id>`" in (DOCS / "slurm.md").read_text()


@pytest.mark.parametrize("page", ["cli.md", "slurm.md"])
def test_the_run_options_sbatch_refuses_are_the_ones_the_pages_name(page: str):
    from procckpt.launcher.config import OPTIONS, PASSED_ON, SBATCH_OWN

    refused = {o.flag for o in OPTIONS.values() if o.sbatch not in (PASSED_ON, SBATCH_OWN)}
    text = " ".join((DOCS / page).read_text().split())
    said = re.search(r"(?:every option|all) but ((?:`--[a-z-]+`(?:, | and ))+`--[a-z-]+`)", text)
    assert said, f"docs/{page} does not say which run options sbatch does not pass on"
    assert set(re.findall(r"`(--[a-z-]+)`", said.group(1))) == refused, said.group(0)


def _in_other_tables(flag: str) -> bool:
    """An option of another command (its own tables in the same page)."""
    return any(flag in known_options(command) for name, command in cli.commands.items()
               if name != "run")
