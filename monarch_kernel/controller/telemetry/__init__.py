"""Step telemetry of a mesh's ranks, in the controller: what each rank's training steps
spent where, the straggler named, and ``%mesh profile``'s traces merged.

:class:`~.steps.MeshTelemetry` (one per mesh, made by ``MeshRuntime``) takes the ranks'
``steps`` batches (``wire.steps``), keeps each rank's recent steps for the dashboard
(:meth:`~.steps.MeshTelemetry.breakdown`, :meth:`~.steps.MeshTelemetry.heat`) and hands
every complete step to the :class:`~.stragglers.StragglerDetector`; its notices go to
the process's notice hook (:func:`~.steps.set_notice_hook`, set by the kernel: a line
under the running cell) and to the mesh's own listeners (the dashboard).
:mod:`.traces` merges the ranks' profiler traces onto one time axis.
"""
