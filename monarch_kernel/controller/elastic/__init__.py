"""Growing and shrinking a live mesh (``%mesh grow`` / ``shrink`` / ``drop``): what a
resize changes and its words (``plan``), ranks and hosts joining and leaving
(``members``), renumbering the survivors (``renumber``), the resize itself
(``resize``) and the resize of a ``--bg`` ``TrainingState`` loop at a step boundary
(``training_loop``). Sits on ``state``, ``messaging``, ``lifecycle`` and ``training``."""

from monarch_kernel.controller.elastic.plan import ResizeError, ResizePlan
from monarch_kernel.controller.elastic.resize import Resizer

__all__ = ["ResizeError", "ResizePlan", "Resizer"]
