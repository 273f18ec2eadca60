"""The tensor engine, controller side: the mesh as one device (Monarch's tensor engine).

While a mesh is active (``with procs.activate():``), torch ops issued in the notebook
create and operate on *mesh tensors*: one local tensor per rank, with shape and dtype
computed here on FakeTensors before anything is sent; the ops stream to the ranks in
order, batched, as ``tensor_ops`` messages; ``fetch_shard`` / ``inspect`` bring a rank's
values back; an op that fails on a rank poisons its outputs and the next fetch of a
dependent value raises :class:`RemoteException`. The rank side is
:mod:`monarch_kernel.rank.tensors`; the records are :mod:`monarch_kernel.wire.tensor_ops`.

Parts, lowest first: ``errors``, ``state`` (the activation stacks), ``client`` (one per
process mesh: refs, seqs, batching, drops, fetches), ``streams`` (``Stream``, what a
storage allows), ``tensor`` (the ``Tensor`` wrapper subclass, the dispatch), ``mesh``
(``DeviceMesh``, activation, ``no_mesh``), ``fetch``, ``moves`` (``slice_mesh``,
``to_mesh``), ``reductions``, ``remote_functions``, ``endpoint_rref`` (an actor
endpoint's ``rref``), ``borrows``, ``gradients`` (``grad_generator``,
``grad_function``), ``opaque`` (``OpaqueRef``, ``OpaqueObject``, ``OpaqueModule``),
``remote_autograd`` (``remote_autograd_function``), ``random`` (Monarch's
``monarch.random``).

Face: ``Tensor``, ``DeviceMesh``, ``no_mesh``, ``get_active_mesh``, ``fetch_shard``,
``inspect``, ``show``, ``reduce``, ``reduce_``, ``remote``, ``call_on_shard_and_fetch``,
``slice_mesh``, ``to_mesh``, ``Stream``, ``get_active_stream``, ``grad_generator``,
``grad_function``, ``RemoteException``, ``OpaqueRef``, ``OpaqueObject``, ``opaque_method``,
``OpaqueModule``, ``remote_autograd_function``.
"""

# loaded with the engine: the actor layer looks it up to pack mesh-tensor arguments
import monarch_kernel.tensor_engine.actor_args  # noqa: F401
from monarch_kernel.tensor_engine.borrows import Borrow
from monarch_kernel.tensor_engine.errors import RemoteException
from monarch_kernel.tensor_engine.fetch import fetch_shard, inspect, show
from monarch_kernel.tensor_engine.gradients import grad_function, grad_generator
from monarch_kernel.tensor_engine.mesh import DeviceMesh, device_mesh, get_active_mesh, no_mesh
from monarch_kernel.tensor_engine.moves import slice_mesh, to_mesh
from monarch_kernel.tensor_engine.opaque import OpaqueModule, OpaqueObject, OpaqueRef, opaque_method
from monarch_kernel.tensor_engine.process_groups import RemoteProcessGroup
from monarch_kernel.tensor_engine.reductions import reduce, reduce_
from monarch_kernel.tensor_engine.remote_autograd import remote_autograd_function
from monarch_kernel.tensor_engine.remote_functions import Remote, call_on_shard_and_fetch, remote
from monarch_kernel.tensor_engine.streams import Stream, get_active_stream
from monarch_kernel.tensor_engine.tensor import Tensor

__all__ = [
    "Borrow",
    "DeviceMesh",
    "OpaqueModule",
    "OpaqueObject",
    "OpaqueRef",
    "opaque_method",
    "Stream",
    "get_active_stream",
    "grad_function",
    "grad_generator",
    "RemoteException",
    "Tensor",
    "device_mesh",
    "fetch_shard",
    "get_active_mesh",
    "inspect",
    "show",
    "no_mesh",
    "reduce",
    "reduce_",
    "remote",
    "Remote",
    "remote_autograd_function",
    "RemoteProcessGroup",
    "slice_mesh",
    "to_mesh",
    "call_on_shard_and_fetch",
]
