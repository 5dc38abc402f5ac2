"""What follows a cycle, row by row (launcher/decide.py), and the exit codes of its one table
against the table users read (docs/cli.md). tests/test_supervisor.py runs the loop that acts
on these steps; the end-to-end tests run it with real processes."""

from __future__ import annotations

import re

import pytest

from procckpt.launcher.decide import (
    EXIT_CODES,
    NO_PROGRESS_CYCLES,
    Action,
    RunSoFar,
    after_cycle,
    after_node_loss,
    after_verdict,
    procckpt_code,
)
from procckpt.launcher.engines import Confirmation
from procckpt.launcher.restart import Decision, StopCause
from procckpt.launcher.results import CycleOutcome, ExitReason

from .conftest import REPO

pytestmark = pytest.mark.unit

SAVED = Confirmation(checkpoint="ckpt-3", step=30, stopping=True, number=3)
UNSAVED = Confirmation(checkpoint=None, step=None, stopping=True)
DEADLINE = StopCause.DEADLINE
RUN = RunSoFar(restarts=1, max_restarts=5, last_step=20)

#: (how the cycle ended, the run so far) -> (action, reason, why)
AFTER_CYCLE = {
    "the engine falls back": (CycleOutcome(1, retry="no DMTCP here"), RUN,
                              (Action.RETRY, None, "")),
    "an engine that cannot image it": (CycleOutcome(75, DEADLINE), RunSoFar(0, 5, None, "stuck"),
                                       (Action.EXIT, ExitReason.NOT_CHECKPOINTABLE,
                                        "engine-stuck")),
    "...unless it saved": (CycleOutcome(0, DEADLINE, confirmed=SAVED),
                           RunSoFar(0, 5, None, "stuck"), (Action.ASK_POLICY, None, "")),
    "a node lost": (CycleOutcome(1, lost_nodes=["n2"]), RUN, (Action.NODE_LOSS, None, "")),
    "hung, budget left": (CycleOutcome(137, hung=True), RUN, (Action.RESTART, None, "hang")),
    "hung, budget spent": (CycleOutcome(137, hung=True), RunSoFar(5, 5, 20),
                           (Action.EXIT, ExitReason.HUNG, "")),
    "hung as it finished": (CycleOutcome(0, hung=True, finished=True), RunSoFar(5, 5, 20),
                            (Action.EXIT, ExitReason.FINISHED, "")),
    "no space": (CycleOutcome(74, procckpt_code=74), RUN,
                 (Action.EXIT, ExitReason.STORAGE_FAILED, "")),
    "no space on a rank, torchrun exits 1": (CycleOutcome(1, procckpt_code=74), RUN,
                                             (Action.EXIT, ExitReason.STORAGE_FAILED, "")),
    "the command's own 74": (CycleOutcome(74), RUN, (Action.UNREQUESTED, None, "")),
    "every checkpoint damaged": (CycleOutcome(65, procckpt_code=65), RUN,
                                 (Action.EXIT, ExitReason.CHECKPOINTS_UNUSABLE, "")),
    "a resume's first batch differs, strict": (
        CycleOutcome(66, audit_refused=True), RUN, (Action.EXIT, ExitReason.AUDIT_REFUSED, "")),
    "...told by a rank under torchrun, which exits 1": (
        CycleOutcome(1, audit_refused=True), RUN, (Action.EXIT, ExitReason.AUDIT_REFUSED, "")),
    "finished": (CycleOutcome(0, finished=True), RUN, (Action.EXIT, ExitReason.FINISHED, "")),
    "finished as its stop came": (CycleOutcome(143, DEADLINE, finished=True), RUN,
                                  (Action.EXIT, ExitReason.FINISHED, "")),
    "finished, then crashed": (CycleOutcome(3, finished=True), RUN,
                               (Action.EXIT, ExitReason.FAILED, "finished-then-failed")),
    "exited unasked": (CycleOutcome(3), RUN, (Action.UNREQUESTED, None, "")),
    "stopped, never connected, nothing saved ever": (
        CycleOutcome(124, DEADLINE), RunSoFar(0, 5, None),
        (Action.EXIT, ExitReason.NOT_CHECKPOINTABLE, "never-connected")),
    "...but only slow to start": (CycleOutcome(124, DEADLINE),
                                  RunSoFar(0, 5, None, slow_start="a slow start"),
                                  (Action.ASK_POLICY, None, "")),
    "...with a checkpoint from before": (CycleOutcome(124, DEADLINE), RUN,
                                         (Action.ASK_POLICY, None, "")),
    "stopped with its checkpoint": (CycleOutcome(0, DEADLINE, confirmed=SAVED, connected=True),
                                    RUN, (Action.ASK_POLICY, None, "")),
    "stopped, its checkpoint never came": (CycleOutcome(137, DEADLINE, connected=True), RUN,
                                           (Action.ASK_POLICY, None, "")),
}


@pytest.mark.parametrize("case", AFTER_CYCLE)
def test_what_follows_a_cycle(case: str):
    outcome, run, (action, reason, why) = AFTER_CYCLE[case]
    step = after_cycle(outcome, run)
    assert (step.action, step.reason, step.why) == (action, reason, why)


#: (the policy's decision, cycles without progress, the stop's checkpoint came) -> step
AFTER_VERDICT = [
    (Decision.RESTART_HERE, 0, True, Action.RESTART, None),
    (Decision.RESTART_HERE, NO_PROGRESS_CYCLES - 1, False, Action.RESTART, None),
    (Decision.RESTART_HERE, NO_PROGRESS_CYCLES, False, Action.EXIT, ExitReason.NO_PROGRESS),
    (Decision.REQUEUED, 0, True, Action.EXIT, ExitReason.REQUEUED),
    (Decision.REQUEUED, 0, False, Action.EXIT, ExitReason.REQUEUED),
    (Decision.BUDGET_EXHAUSTED, 0, True, Action.EXIT, ExitReason.BUDGET_EXHAUSTED),
    (Decision.EXIT_RETRY, 0, True, Action.EXIT, ExitReason.CHECKPOINTED),
    (Decision.EXIT_RETRY, 0, False, Action.EXIT, ExitReason.UNSAVED_STOP),
]


@pytest.mark.parametrize("decision, stalled, saved, action, reason", AFTER_VERDICT)
def test_what_follows_the_policys_word_on_a_stop(decision, stalled, saved, action, reason):
    step = after_verdict(decision, stalled, saved)
    assert (step.action, step.reason) == (action, reason)


def test_a_lost_node_never_restarts_here():
    assert [after_node_loss(d) for d in Decision] == [
        ExitReason.CHECKPOINTED, ExitReason.REQUEUED, ExitReason.CHECKPOINTED,
        ExitReason.BUDGET_EXHAUSTED]


def test_every_ending_has_an_exit_code_and_each_is_in_the_docs_table():
    assert set(EXIT_CODES) == set(ExitReason)
    rows = {}
    for line in (REPO / "docs" / "cli.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"\d+", cells[0]):
            rows[int(cells[0])] = cells[1]
    missing = {reason.value: code for reason, code in EXIT_CODES.items()
               if code is not None and not rows.get(code)}
    assert not missing, f"docs/cli.md's exit-code table has no `procckpt run` row for {missing}"
    # Every code the table gives `procckpt run` comes from here, but those of the command line
    # (2: bad input, 127: no such command), which the commands raise before any run.
    unexplained = set(rows) - set(EXIT_CODES.values()) - {2, 127}
    assert not unexplained, f"docs/cli.md says `procckpt run` exits {unexplained}"


def test_procckpts_own_code_comes_from_the_ranks_notes_not_the_command():
    assert procckpt_code([{"rank": 1, "code": 74}], 1) == 74  # torchrun's 1 hides it
    assert procckpt_code([{"code": 66}, {"code": 74}], 1) == 74  # storage first
    assert procckpt_code([], 74) is None  # the script's own 74
    assert procckpt_code(None, 74) == 74 and procckpt_code(None, 3) is None  # no notes at all
