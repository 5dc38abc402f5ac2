"""What the launcher says of the checkpoint dir: where a rerun resumes, the newest intact one."""

from __future__ import annotations

from ..store import CheckpointStore

__all__ = ["newest_intact", "restart_number", "resumes_from"]


def restart_number(store: CheckpointStore, restarts: int) -> int:
    """The restart count the training is told (and says): this launch's, or one more than
    the newest checkpoint's if that is more (a rerun by hand is a restart too). The
    --max-restarts budget counts this launch's alone."""
    try:
        infos = store.checkpoints()
    except OSError:
        infos = []
    saved = infos[0].manifest.get("restart") if infos else None
    return max(restarts, saved + 1) if isinstance(saved, int) else restarts


def newest_intact(store: CheckpointStore) -> str:
    """Whether the newest checkpoint still verifies (after a storage failure), in words."""
    try:
        infos = store.checkpoints()
        if not infos:
            return "there is no checkpoint yet"
        problem = store.verify(infos[0].path)
    except Exception as e:  # the storage is failing: say so, do not fail the exit
        return f"the newest checkpoint could not be checked ({e})"
    if problem is not None:
        return f"the newest checkpoint, {infos[0].name}, is damaged ({problem})"
    step = f" (step {infos[0].step})" if infos[0].step is not None else ""
    return f"the newest checkpoint, {infos[0].name}{step}, verified intact"


def resumes_from(store: CheckpointStore, verb: str = "resumes") -> str:
    """Where the next start of the command begins, in words: 'resumes from ckpt-N
    (step S)' or 'starts from the beginning (no checkpoint yet)'."""
    try:
        infos = store.checkpoints()
    except OSError:
        infos = []
    if not infos:
        return "starts from the beginning (no checkpoint yet)"
    step = f" (step {infos[0].step})" if infos[0].step is not None else ""
    return f"{verb} from {infos[0].name}{step}"
