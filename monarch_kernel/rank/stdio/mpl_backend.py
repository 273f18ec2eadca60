"""matplotlib's backend in a rank (``module://monarch_kernel.rank.stdio.mpl_backend``).

Agg draws the figures; ``plt.show()`` sends every open figure as a PNG display under the
cell or endpoint running (see :mod:`.display`) and closes it, and the
figures a cell leaves open are sent when it ends (:func:`flush_figures`), as
``matplotlib_inline`` does in a notebook. Imported only once matplotlib picks it.
"""

from __future__ import annotations

from typing import Any

import matplotlib
from matplotlib._pylab_helpers import Gcf
from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from monarch_kernel.rank.stdio import display as _display

FigureCanvas = FigureCanvasAgg
FigureManager = FigureManagerBase


def show(*args: Any, block: bool | None = None, **kwargs: Any) -> None:
    """Send every open figure under the cell, then close them."""
    managers = Gcf.get_all_fig_managers()
    try:
        for manager in managers:
            _display.display(manager.canvas.figure)
    finally:
        for manager in managers:
            Gcf.destroy(manager)


def flush_figures() -> None:
    """The end of a cell: show the figures still open, if this backend is pyplot's."""
    if not Gcf.get_all_fig_managers():
        return
    if matplotlib.get_backend() != _display.MPL_BACKEND:
        return  # the user switched backends: their figures are theirs
    show()
