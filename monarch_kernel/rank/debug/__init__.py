"""Debuggers inside a rank: ``pdb`` with its prompts forwarded to the notebook
(``debugger``), and the Debug Adapter Protocol for JupyterLab's Debugger panel (``dap``,
with ``dap_values`` for the variables it shows). The kernel's half is
``kernel/debug``."""

from monarch_kernel.rank.debug.dap import DapPdb
from monarch_kernel.rank.debug.debugger import RankDebugger, RankPdb

__all__ = ["DapPdb", "RankDebugger", "RankPdb"]
