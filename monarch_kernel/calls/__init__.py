"""What both kinds of process need to make and answer calls to ranks.

The notebook's controller and a rank calling another mesh share this layer:
:class:`~monarch_kernel.calls.future.Future`, the :class:`~monarch_kernel.calls.reply.Reply`
of one rank and the :class:`~monarch_kernel.calls.reply.RequestObserver` it is told to,
the one gather path (:mod:`~monarch_kernel.calls.gather`: ``Gather``, ``One``, ``Each``
and :class:`~monarch_kernel.calls.value_mesh.ValueMesh`), the errors users see
(:mod:`~monarch_kernel.calls.errors`) and the :class:`~monarch_kernel.calls.requester.Requester`
protocol every mesh handle sends through. It imports only ``shape`` and ``wire``.
"""
