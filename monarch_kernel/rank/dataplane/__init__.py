"""Tensors moved rank to rank directly, never through the controller: :func:`share`
keeps a tensor and returns a picklable ``TensorRef``; ``TensorRef.get`` pulls the bytes
from the owner (shared memory on one host, a socket across hosts). ``plane`` is this
rank's plane (the face), ``client``/``server`` its two ends, ``ref`` the handle,
``common`` what both ends share."""

from monarch_kernel.rank.dataplane.plane import share
from monarch_kernel.rank.dataplane.ref import TensorRef

__all__ = ["TensorRef", "share"]
