"""Controller: mesh state, request/future table, supervision and slicing."""
