"""Borrows: ``stream.borrow(t, mutable=False)`` lends mesh tensor ``t`` to another stream.

The borrowed tensor is a new mesh tensor of the borrowing stream naming the same local
tensor on each rank (no copy). While the borrow lives, its lender's storage allows
less (:class:`~.streams.StorageAliases`): a plain borrow makes both sides read-only
(writing either raises ``MUTATING_BORROW``); a ``mutable`` one gives the borrower
reading and writing and the lender nothing (``BORROWED``), and a storage lent read-only
cannot be lent mutably. ``borrow.drop()`` (or the end of ``with borrow:``) drops the
borrowed tensor and its views (using one after raises ``DROPPED``, naming where it was
dropped) and gives the lender its access back once no borrow of it is left; an error the
borrower's ops left in a mutable borrow's tensors reaches the lender's. A borrow
collected without ``drop()`` warns and drops itself.
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.streams import StorageAliases, Stream, drop_location
from monarch_kernel.tensor_engine.tensor import Tensor, dropped_error, new_tensor, on_fakes
from monarch_kernel.wire.tensor_ops import BorrowCreate, BorrowDrop


class Borrow:
    """One borrow (see the module docstring): ``drop()`` ends it; a context manager
    whose end drops it."""

    def __init__(self, borrowed: Tensor, lender: StorageAliases, mutable: bool):
        self._borrowed = borrowed
        self._aliases: StorageAliases = borrowed._aliases
        self._lender = lender
        self._mutable = mutable
        self._dropped = False
        self._frames = traceback.extract_stack()[:-3]

    @property
    def traceback_string(self) -> str:
        """Where the borrow was made."""
        return "".join(traceback.format_list(self._frames))

    @property
    def dropped(self) -> bool:
        """Whether :meth:`drop` ran."""
        return self._dropped

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()

    def drop(self) -> None:
        """End the borrow: its tensors are dropped, the lender's access comes back."""
        if self._dropped:
            return
        self._dropped = True
        borrowed = self._borrowed
        mesh = borrowed._mesh
        where = drop_location(borrowed.ref)
        refs = []
        for alias in [*self._aliases.aliases, borrowed]:
            if not alias._dropped:
                alias._dropped = True  # freed by the BorrowDrop below, not a Drop
                alias._drop_location = where
                refs.append(alias.ref)
        origin = tuple(a.ref for a in self._lender.aliases if not a._dropped)
        client = mesh.client
        client.issue(
            mesh.rank_tuple, BorrowDrop(client.new_seq(), tuple(refs), origin, self._mutable)
        )
        lender = self._lender
        lender.live_borrows.discard(self)
        if not lender.live_borrows:
            lender.access = lender.granted

    def __del__(self) -> None:
        if not getattr(self, "_dropped", True):
            warnings.warn(
                "borrow.drop() must be called before a borrow is freed (it says when the "
                "borrowed tensor returns to its stream); it is dropped now. Borrowed "
                f"at (most recent call last):\n{self.traceback_string}",
                stacklevel=2,
            )
            try:
                self.drop()
            except Exception:  # a stopped mesh
                pass


def borrow(stream: Stream, t: Any, mutable: bool = False) -> tuple[Tensor, Borrow]:
    """``stream.borrow(t, mutable)`` (see the module docstring)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"borrow: {type(t).__name__} is not a mesh tensor")
    if t._dropped:
        raise dropped_error("borrow", t)
    lender = t._aliases
    if mutable:
        if "w" not in lender.access:
            raise RuntimeError(
                "Cannot borrow this tensor mutably because it (or a view) is already "
                "being borrowed non-mutably."
            )
    elif "r" not in lender.access:
        raise RuntimeError(
            "Cannot borrow this tensor because it (or a view) is borrowed mutably by "
            "another stream."
        )
    mesh = t._mesh
    with on_fakes():
        fake = t._fake.clone()
    r = new_tensor(fake, mesh, stream)
    aliases = r._aliases
    aliases.borrowed_from = lender
    if mutable:
        lender.access = ""
        aliases.access = "rw"
    else:
        lender.access = aliases.access = "r"
    aliases.granted = aliases.access
    b = Borrow(r, lender, mutable)
    lender.live_borrows.add(b)
    client = mesh.client
    client.issue(mesh.rank_tuple, BorrowCreate(client.new_seq(), t.ref, r.ref))
    return r, b


state.reducers.update(borrow=borrow)
