"""Sharded training on the mesh's own dims (FSDP2 and HSDP), on the rank side.

* :mod:`.mesh`: ``device_mesh()``, torch's ``DeviceMesh`` over the mesh's named dims;
* :mod:`.policy`: ``shard_model()``, FSDP2 applied by a policy, and the plan it printed;
* :mod:`.fingerprint`: what each rank's model looks like sharded, compared across ranks
  (``check()``, ``ShardingError`` naming the tensor and the ranks that disagree);
* :mod:`.explain`: a note naming the DTensors of a failed DTensor operation;
* :mod:`.hooks`: the automatic part, installed in every rank (FSDP2's first forward
  compares the ranks' models; failures get the note).

Which ranks hold the same shards, how sharded state travels to a restarted rank and how
FSDP2 is reset after a step cut short live with the other replicas' code, below the
process group: :mod:`monarch_kernel.rank.replicas.shards` and
:mod:`monarch_kernel.rank.replicas.fsdp_reset`. The public face is
:mod:`monarch_kernel.sharding`.
"""
