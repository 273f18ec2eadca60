"""The notebook's side of debugging ranks: rank pdb prompts served through the
notebook's ``input()`` (``console``), and the Debug Adapter Protocol relayed between
JupyterLab's Debugger panel and the ranks (``relay``, ``requests``, ``endpoints``). The
``%debug_remote`` magic is ``kernel/debug_remote.py``; the rank's half is
``rank/debug``."""

from monarch_kernel.kernel.debug.console import DebugConsole
from monarch_kernel.kernel.debug.relay import DapRelay

__all__ = ["DapRelay", "DebugConsole"]
