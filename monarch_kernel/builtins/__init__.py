"""Monarch's ``monarch.builtins``: remote functions for common torch and logging calls,
run on every rank of the active mesh (``log_remote``, ``set_manual_seed_remote`` ...).
``builtins.log`` and ``builtins.random`` hold them, as in Monarch."""

from monarch_kernel.builtins.log import log_remote, set_logging_level_remote

__all__ = ["log_remote", "set_logging_level_remote"]
