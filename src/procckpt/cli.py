"""The ``procckpt`` command. Thin: parse, build the config, call, map errors to exit codes."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import EX_USAGE, ProcckptError, UsageError
from .launcher.config import CONFIG_FILE, OPTIONS, Option, RunConfig, load_config, shown_default
from .launcher.deadline import Deadline
from .launcher.restart import RestartPolicy
from .log import setup_logging

__all__ = ["main", "cli"]

logger = logging.getLogger("procckpt")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="procckpt")
def cli() -> None:
    """Checkpoint, requeue and resume PyTorch training across time limits."""


def run_option(option: Option, **override: Any) -> Callable[[Any], Any]:
    """The click option for one run option of launcher/config.py's table (None: not given)."""
    settings: dict[str, Any] = {
        "default": None, "metavar": option.metavar or None,
        "help": f"{option.help} [{shown_default(option)}]", **override}
    if option.kind == "switch":
        return click.option("/".join(option.flags()), option.name, **settings)
    return click.option(option.flag, option.name, is_flag=option.kind == "flag", **settings)


def run_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of the table, in its order, then --config."""
    command = click.option("--config", "config_path", metavar="FILE",
                           help=f"Config file [./{CONFIG_FILE}].")(command)
    for option in reversed(OPTIONS.values()):
        command = run_option(option)(command)
    return command


@cli.command(context_settings={"allow_interspersed_args": False})
@run_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(command: tuple[str, ...], config_path: str | None, **options: Any) -> None:
    """Run COMMAND, checkpoint it before its deadline, and restart it until it finishes.

    \b
    Example:
        procckpt run --time-limit 15m -- python train.py
    """
    config = load_config(options, list(command), config_path=config_path)
    sys.exit(run_command(config))


def run_command(config: RunConfig) -> int:
    """Everything ``procckpt run`` does after parsing (launcher/launch.py), with Slurm's
    deadline and policy where it runs in a job; returns the exit code."""
    from .launcher.launch import launch
    from .schedulers.slurm import slurm_deadline_and_policy

    def scheduled(config: RunConfig) -> tuple[Deadline, RestartPolicy] | None:
        slurm = slurm_deadline_and_policy(config)  # None outside a Slurm job
        return None if slurm is None else (slurm.deadline, slurm.policy)

    return launch(config, scheduled)


class _RawArgsCommand(click.Command):
    """Keeps the arguments as typed: click would drop the first ``--``, which ``procckpt
    sbatch`` needs to tell sbatch options from the command."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["raw_args"] = list(args)
        return super().parse_args(ctx, args)


@cli.command(cls=_RawArgsCommand, context_settings={"ignore_unknown_options": True,
                                                     "allow_interspersed_args": False})
@click.option("--chain", metavar="N", help="For sites that forbid requeue: an array of N tasks "
              "run one after another (--array=1-N%1), each resuming from the checkpoint.")
@click.option("--dry-run", is_flag=True, help="Print the job script instead of submitting it.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def sbatch(ctx: click.Context, **_: Any) -> None:
    """Write a job script that runs COMMAND under procckpt run, and submit it.

    \b
    procckpt sbatch [OPTIONS] [SBATCH OPTIONS] -- COMMAND [ARGS]...

    The script asks for --requeue, --open-mode=append and --signal=B:USR1@GRACE, and runs
    `exec procckpt run ... -- COMMAND`: procckpt checkpoints before the time limit, requeues
    the job and resumes it, as many times as it takes. Every other sbatch option (-t, -p,
    --gres, --mem, -J, -o, ...) goes into the script untouched; every procckpt run option
    but --time-limit (the job's -t is the limit), --force and --node-rank is passed on to
    procckpt run, and procckpt.yaml and PROCCKPT_* are read for the --signal lead as the job
    will read them. A COMMAND that is a job script with #SBATCH lines is wrapped: its #SBATCH
    lines are kept. Pyxis options (--container-image, --container-name, --container-mounts, ...)
    run procckpt inside the
    container with srun; the job script requeues from outside.

    \b
    Examples:
        procckpt sbatch -t 4:00:00 --gres=gpu:1 -- python train.py
        procckpt sbatch --dry-run -t 30 -- ./train.sbatch
        procckpt sbatch --chain 10 -t 4:00:00 -- python train.py
    """
    from .schedulers.sbatch import sbatch_main

    sys.exit(sbatch_main(ctx.meta["raw_args"]))


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--steps", type=int, default=20, show_default=True,
              help="Steps to compare (fewer if the script has fewer).")
@click.option("--at", type=int, default=None, help="Stop and resume after this step [half "
              "of --steps].")
@click.option("--keep", is_flag=True, help="Keep the runs' dirs, logs and traces.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def check(command: tuple[str, ...], steps: int, at: int | None, keep: bool) -> None:
    """Prove that COMMAND resumes exactly: run it without a stop, again, and stopped in the
    middle and resumed, and compare the whole state after every step, bit for bit.

    \b
    Example:
        procckpt check --steps 20 -- python train.py --epochs 1
    Exit: 0 exact; 1 differs or not deterministic; 2 bad input; 127 command not found.
    """
    from .check import describe, run_check

    verdict = run_check(list(command), steps, at, keep=keep)
    click.echo(describe(verdict))
    sys.exit(verdict.code)


@cli.command()
@click.argument("directory", required=False, default="procckpt-checkpoints")
@click.option("--no-verify", is_flag=True, help="Do not read files to check their checksums.")
@click.option("--events", default=8, show_default=True, help="How many recent events to show.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object (state, goodput, checkpoints, recent events).")
def status(directory: str, no_verify: bool, events: int, as_json: bool) -> None:
    """Show the checkpoints, goodput, restarts and recent events of a checkpoint DIRECTORY
    (for s3://BUCKET/PREFIX: of its local dir, and what the prefix holds)."""
    from .store.remote import split_location

    local, remote = split_location(directory)
    if remote is not None and not local.exists():  # another machine's run: the prefix alone
        from .inspect.status import remote_status_data, render_remote_status

        if as_json:
            import json

            click.echo(json.dumps(remote_status_data(remote), indent=1, default=str))
        else:
            click.echo(render_remote_status(remote))
        return
    if as_json:
        import json

        from .inspect.status import status_data

        data = status_data(local, events=events, verify=not no_verify)
        click.echo(json.dumps(data, indent=1, default=str))
        return
    from .inspect.status import render_status

    click.echo(render_status(local, events=events, verify=not no_verify))


@cli.command()
@click.argument("directory", required=False, default="procckpt-checkpoints")
@click.option("-o", "--output", metavar="FILE.html",
              help="Where to write the page [DIRECTORY/report.html].")
def report(directory: str, output: str | None) -> None:
    """Write one self-contained HTML page with the run's timeline: cycles as bars coloured by
    what their time went to, checkpoints, restarts and their causes, the goodput.

    \b
    Example:
        procckpt report procckpt-checkpoints -o run.html   # then open it, or scp it home
    """
    from .inspect.report import write_report
    from .store.remote import split_location

    local, _ = split_location(directory)  # s3://...: its local dir holds the journal
    path = write_report(local, Path(output) if output else None)
    click.echo(f"wrote {path}")


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--image", required=True, help="Container image with procckpt and the training code.")
@click.option("--pvc", required=True, metavar="CLAIM",
              help="PersistentVolumeClaim that holds the checkpoint dir.")
@click.option("--name", default="procckpt-train", show_default=True, help="Job name.")
@click.option("--namespace", help="Namespace of the Job.")
@click.option("--mount-path", default="/checkpoints", show_default=True,
              help="Where the claim is mounted in the pod.")
@click.option("--dir", "dir_", metavar="DIR", help="Checkpoint dir in the pod [MOUNT-PATH/NAME].")
@click.option("--cpu", metavar="QUANTITY", help="CPU request, e.g. 8 or 500m.")
@click.option("--memory", metavar="QUANTITY", help="Memory request and limit, e.g. 64Gi.")
@click.option("--gpus", type=int, default=0, show_default=True, help="GPUs (limit).")
@click.option("--gpu-resource", default="nvidia.com/gpu", show_default=True,
              help="Extended resource name of a GPU.")
@click.option("--node-selector", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--queue", metavar="NAME", help="Kueue LocalQueue (label kueue.x-k8s.io/queue-name).")
@run_option(OPTIONS["grace"], help="Time the checkpoint may take after SIGTERM (also "
            f"before --time-limit) [{shown_default(OPTIONS['grace'])}].")
@run_option(OPTIONS["max_restarts"], help="Restart budget (backoffLimit) "
            f"[{shown_default(OPTIONS['max_restarts'])}].")
@run_option(OPTIONS["time_limit"], help="Also restart inside the pod this often.")
@click.option("--env", "env_", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.option("--shm", metavar="QUANTITY", help="Size of a memory-backed /dev/shm, e.g. 8Gi.")
@click.option("--nodes", type=int, default=1, show_default=True,
              help="Pods (nodes) the torchrun command spans: an Indexed Job and a headless "
                   "Service; the claim must be ReadWriteMany.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def k8s(command: tuple[str, ...], dir_: str | None, grace: str | None, max_restarts: str | None,
        time_limit: str | None, node_selector: tuple[str, ...], env_: tuple[str, ...],
        **options: Any) -> None:
    """Print a Kubernetes batch/v1 Job that runs COMMAND under procckpt run.

    \b
    Example:
        procckpt k8s --image ghcr.io/me/train:1 --pvc ckpts --gpus 8 --queue team-a \\
            -- torchrun --nproc-per-node 8 train.py | kubectl apply -f -
        procckpt k8s --image ghcr.io/me/train:1 --pvc shared-ckpts --gpus 8 --nodes 4 \\
            -- torchrun --nproc-per-node 8 train.py | kubectl apply -f -
    """
    from .schedulers.k8s import K8sJobSpec, render_manifest

    # Read as `procckpt run` reads them, PROCCKPT_* and procckpt.yaml included (the pod's
    # run is given them explicitly; it reads its other options in the pod).
    given = {"grace": grace, "max_restarts": max_restarts, "time_limit": time_limit}
    run = load_config(given, list(command), only=given)
    spec = K8sJobSpec(
        command=list(command), dir=dir_, grace=run.grace_for(run.time_limit),
        max_restarts=run.max_restarts, time_limit=run.time_limit,
        node_selector=_pairs(node_selector, "--node-selector"), env=_pairs(env_, "--env"),
        **options)
    click.echo(render_manifest(spec), nl=False)


def _pairs(items: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"bad {what} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line errors, exit codes from errors.py."""
    setup_logging()
    try:
        cli.main(args=argv, prog_name="procckpt", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        print("procckpt: aborted", file=sys.stderr)
        return 130
    except click.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        print(f"procckpt: error: {e.format_message()}{hint}", file=sys.stderr)
        return EX_USAGE
    except click.ClickException as e:
        print(f"procckpt: error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except ProcckptError as e:
        print(f"procckpt: error: {e}", file=sys.stderr)
        return e.exit_code
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
