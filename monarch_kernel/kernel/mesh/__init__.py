"""The ``%mesh`` magic's verbs: create (``create``), stop/restart/setup/stacks
(``admin``), grow/shrink/drop (``resize``), detach/attach/list (``detach``), and the
checks of a mesh's name (``names``). ``kernel/magics.py`` dispatches to them."""

from monarch_kernel.kernel.mesh.admin import stop_mesh
from monarch_kernel.kernel.mesh.create import create_mesh
from monarch_kernel.kernel.mesh.resize import resize_mesh

__all__ = ["create_mesh", "resize_mesh", "stop_mesh"]
