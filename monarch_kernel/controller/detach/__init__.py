"""Meshes that outlive their kernel: detaching one (``release``), finding and
attaching one another kernel made (``attach``: the host agents' desks), building its
``MeshRuntime`` (``adopt``), and what the new holder does once it has it (``takeover``,
with ``held_output`` for the job output that arrives first). Built on whole meshes as
the kernel uses them, so above ``controller/mesh.py``; nothing below imports it. The
attach file's format is ``controller/attach_file.py`` (the mesh writes it)."""

from monarch_kernel.controller.detach.attach import find_detached, list_detached
from monarch_kernel.controller.detach.release import Detacher

__all__ = ["Detacher", "find_detached", "list_detached"]
