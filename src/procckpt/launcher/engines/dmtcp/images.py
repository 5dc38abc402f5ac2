"""DMTCP's image dir: images written there, found complete, and moved into a store checkpoint.

DMTCP writes its images into ``DIR/dmtcp/images/`` (its ``--ckptdir``). ``dmtcp_command
--bcheckpoint`` returns before they are written, so completion is read from the files: the
coordinator writes its ``dmtcp_restart_script_*.sh`` only after every process renamed its
finished image into place, and sets the script's execute bit after closing it. DMTCP also keeps
copies of some open files beside an image (``<image>_files/``) and needs them at restart under
the absolute path they had; they are stored in the checkpoint and put back.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from ....store import CheckpointInfo, CheckpointStore
from .tools import DmtcpError

__all__ = ["ImageDir", "restore_saved_files", "saved_files"]

logger = logging.getLogger(__name__)

_GIVEN_FILES_RE = re.compile(r'^given_ckpt_files="([^"]*)"', re.MULTILINE)


class ImageDir:
    """The directory DMTCP writes this run's images into."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def reset(self) -> None:
        """Empty it: what an earlier cycle left there (a half-written ``.temp`` image, an old
        restart script) must not be taken for this cycle's images."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir()

    def bytes_written(self) -> int:
        """Bytes in the dir so far: the images being written and those finished."""
        total = 0
        for f in self.path.iterdir():
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # renamed from .temp meanwhile
                continue
        return total

    def writing(self) -> bool:
        """Whether an image is being written right now."""
        return any(self.path.glob("*.temp"))

    def finished_script(self) -> Path | None:
        """The coordinator's restart script once it is complete (execute bit set), else None."""
        for script in self.path.glob("dmtcp_restart_script_*.sh"):
            try:
                if script.stat().st_mode & stat.S_IXUSR:
                    return script
            except FileNotFoundError:
                continue
        return None

    def image_names(self, script: Path) -> list[str]:
        """The images the restart script names; all of them must be here.

        Raises:
            DmtcpError: an image it names is missing.
        """
        found = _GIVEN_FILES_RE.search(script.read_text(errors="replace"))
        names = [Path(p).name for p in found.group(1).split()] if found else []
        if not names:  # a DMTCP that writes its script differently: all images are ours
            names = sorted(p.name for p in self.path.glob("*.dmtcp"))
        missing = [n for n in names if not (self.path / n).is_file()]
        if missing or not names:
            raise DmtcpError(f"DMTCP reported images {names} but {missing or 'none'} are missing "
                             f"from {self.path}")
        return names

    def commit(self, store: CheckpointStore, names: list[str],
               meta: dict[str, Any]) -> CheckpointInfo:
        """Move the images ``names`` and the files saved beside them into a new checkpoint of
        ``store``; ``meta["dmtcp"]["saved_files"]`` records where each saved file belongs."""
        saved: dict[str, str] = meta["dmtcp"].setdefault("saved_files", {})
        with store.begin(meta) as pending:
            for name in names:
                os.rename(self.path / name, pending.path / name)
                pending.add_file(name)
                files_dir = self.path / (name.removesuffix(".dmtcp") + "_files")
                for path in saved_files(files_dir):
                    payload = f"saved-{len(saved):03d}-{path.name}"
                    os.rename(path, pending.path / payload)
                    pending.add_file(payload)
                    saved[payload] = str(path.relative_to(self.path))
            for script in self.path.glob("dmtcp_restart_script*.sh"):
                script.unlink(missing_ok=True)
            return pending.commit()


def restore_saved_files(image: CheckpointInfo, default_root: Path) -> None:
    """Put the files DMTCP saved beside the image back where the image expects them."""
    info = image.manifest["dmtcp"]
    target_root = Path(info.get("ckptdir") or default_root)
    for payload, rel in info.get("saved_files", {}).items():
        target = target_root / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # A copy, not a link: DMTCP truncates and rewrites saved files in place at the
            # next checkpoint, which must not change the committed one.
            shutil.copy2(image.file(payload), target)
        except OSError as e:
            logger.warning("dmtcp: cannot put %s back at %s (%s); the restart may fail",
                           payload, target, e.strerror)


def saved_files(files_dir: Path) -> list[Path]:
    """The files DMTCP saved beside an image for this checkpoint.

    ``fd-info.txt`` lists them (``name:original path`` per line); copies left from earlier
    checkpoints, or put back for this cycle's restore, are not listed and not needed.
    """
    if not files_dir.is_dir():
        return []
    everything = sorted(p for p in files_dir.rglob("*") if p.is_file())
    index = files_dir / "fd-info.txt"
    try:
        listed = {line.split(":", 1)[0] for line in index.read_text().splitlines() if line}
    except OSError:
        return everything  # no index: keep all, the restore then finds whatever it needs
    return [p for p in everything if p == index or p.name in listed]
