"""The DMTCP engine: whole-process images of an unmodified command."""

from .coordinator import Coordinator, clean_env
from .engine import CKPT_SIGNAL, DmtcpEngine
from .images import ImageDir, saved_files
from .tools import DmtcpError, DmtcpTools, find_dmtcp, missing_dmtcp_message

__all__ = ["DmtcpEngine", "DmtcpTools", "DmtcpError", "Coordinator", "ImageDir", "find_dmtcp",
           "missing_dmtcp_message", "clean_env", "saved_files", "CKPT_SIGNAL"]
