"""What a rank's user code prints, shows and reads: stdout and stderr captured and sent
in batches (``capture``), IPython displays and matplotlib figures (``display``,
``mpl_backend``, loaded by matplotlib by name), and ``input()`` answered from the
notebook (``stdin``). Sits on ``rank.context``."""

from monarch_kernel.rank.stdio.capture import RankStream
from monarch_kernel.rank.stdio.stdin import RankStdin

__all__ = ["RankStdin", "RankStream"]
