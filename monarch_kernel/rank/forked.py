"""The entry point of a freshly forked rank (:func:`run_forked`) and its way out."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading

from monarch_kernel.rank import context, env
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.signals import TERMINATED_CODE, RankTerminated
from monarch_kernel.rank.stdio import capture
from monarch_kernel.wire.osutil import die_with_parent

log = logging.getLogger("monarch_kernel.rank")

#: How long the exit path waits for ``destroy_process_group`` (it may hang on a peer).
DESTROY_TIMEOUT = 1.0

#: How much lower a rank's CPU priority is than its host agent's and the controller's
#: (``nice``), so that on a machine with more busy ranks than cores the control plane
#: still runs when it must: an agent's heartbeats, the controller's receiving, the
#: notebook. With a core per rank it changes nothing. ``MONARCH_KERNEL_RANK_NICE``
#: (in the kernel's or the mesh's environment) sets it; 0 keeps ranks at their agent's.
RANK_NICE = 5
RANK_NICE_ENV = "MONARCH_KERNEL_RANK_NICE"


def run_forked(cfg: RankConfig, template_pid: int) -> None:
    """Entry point of a freshly forked rank (called by the host template); never returns.

    The rank ends like a Python script: ``sys.exit()`` (or ``sys.exit(None)``) with code
    0, ``sys.exit(n)`` with ``n``, ``sys.exit("message")`` with 1 and the message on
    stderr, an uncaught exception with 1 and its traceback. Then the process group is
    destroyed, ``atexit`` handlers run and the streams are flushed (see :func:`_clean_up`).
    A rank stopped by SIGTERM does all that and then ends killed by SIGTERM.
    """
    code = 0
    terminated = False
    try:
        die_with_parent(signal.SIGKILL, expected_parent=template_pid)
        log_fd = os.open(cfg.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        import faulthandler

        faulthandler.enable(file=log_fd, all_threads=False)
        _register_stacks_dump(cfg.log)
        env.apply(cfg)
        _lower_priority()
        # Same working directory and import path as the controller, so classes that
        # pickle by reference (defined in the user's modules) import here too.
        if cfg.cwd and os.path.isdir(cfg.cwd):
            os.chdir(cfg.cwd)
        sys.path.extend(p for p in cfg.sys_path if p not in sys.path)
        from monarch_kernel.rank.runtime import Rank

        Rank(cfg, log_fd).run()
    except RankTerminated:
        terminated = True
        code = TERMINATED_CODE
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up is not cut short
            runtime = context._runtime
            terminated = terminated or bool(getattr(runtime, "terminating", False))
            _clean_up()
        except BaseException:  # nothing may keep the rank from exiting
            pass
        if terminated:  # stopped: end as the signal asked (the host agent sees SIGTERM)
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            except BaseException:
                pass
        os._exit(code)


def _lower_priority() -> None:
    """Lower this rank's CPU priority by :data:`RANK_NICE` (or what the environment
    says); a value that is not a whole number is ignored (with a line in the log)."""
    raw = os.environ.get(RANK_NICE_ENV, "")
    try:
        step = int(raw) if raw.strip() else RANK_NICE
    except ValueError:
        log.warning("%s=%r is not a whole number: ranks get nice %d", RANK_NICE_ENV, raw, RANK_NICE)
        step = RANK_NICE
    if step > 0:
        try:
            os.nice(step)
        except OSError as exc:
            log.warning("could not lower the rank's CPU priority: %s", exc)


def _register_stacks_dump(log_path: str) -> None:
    """Dump the stack of the thread that gets ``STACKS_SIGNAL`` (the host agent's
    ``dump_stacks`` sends it to the main thread; signal-safe, works while C code holds
    the GIL). Not every thread's: that dump reads the other threads' frames while they
    run, and crashed ranks (see :mod:`monarch_kernel.host.stacks`). The file gets its
    name only once the handler is in place: the agent signals only ranks whose file
    exists."""
    import faulthandler

    from monarch_kernel.wire.stacks import STACKS_SIGNAL, stacks_path

    path = stacks_path(log_path, os.getpid())
    try:
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=False, chain=False)
        os.rename(path + ".tmp", path)
    except (OSError, AttributeError, ValueError, RuntimeError) as exc:  # no fallback, then
        log.warning("rank stacks cannot be dumped with faulthandler: %s", exc)


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as Python gives it to a script."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _end_actors() -> list[tuple[str, object]]:
    """End this rank's actors as Monarch does when it stops a process mesh, while the
    process (and its process group) is still whole: each one's ``__cleanup__(None)``
    (``ActorHost.stop_all``). Returns them, newest first, for :func:`_drop_actors`."""
    runtime = context._runtime
    host = getattr(runtime, "actor_host", None)
    try:
        ended: list[tuple[str, object]] = host.stop_all() if host is not None else []
    except BaseException:  # nothing may keep the rank from exiting
        ended = []
    actors = getattr(runtime, "actors", None)
    if isinstance(actors, dict):  # any left (spawned meanwhile), newest first
        ended.extend(reversed(list(actors.items())))
        actors.clear()
    return ended


def _drop_actors(ended: list[tuple[str, object]]) -> None:
    """Drop the ended actors, newest first, so that their ``__del__`` runs (as when
    Monarch stops a process mesh); ``os._exit`` would skip it."""
    import gc

    if not ended:
        return
    while ended:
        _name, actor = ended.pop(0)
        try:
            del actor
        except BaseException:  # a failing __del__ is printed by Python, not raised
            pass
    gc.collect()


def _clean_up() -> None:
    """What a Python process does on its way out, which ``os._exit`` skips: end the
    actors (``__cleanup__``), tear down the process group (bounded), drop the actors
    (``__del__``), run ``atexit`` handlers, flush the streams."""
    from monarch_kernel.rank.pg import distributed

    ended = _end_actors()
    done = threading.Event()

    def destroy() -> None:
        try:
            distributed.destroy_process_group()
        except Exception:
            pass
        finally:
            done.set()

    if distributed.is_initialized():
        threading.Thread(target=destroy, name="mk-destroy-pg", daemon=True).start()
        done.wait(DESTROY_TIMEOUT)
    _drop_actors(ended)
    _keep_zmq_buffers()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    capture.flush_fds()


def _keep_zmq_buffers() -> None:
    """Keep pyzmq's own atexit hook from running: it stops pyzmq's garbage collector
    and drops the buffers of messages sent without a copy that libzmq's I/O thread may
    still be writing (another thread's output in a flood). The I/O thread then read
    freed memory (SIGSEGV), or its free callback found the collector's socket closed
    (SIGABRT): a rank stopped by SIGTERM in a flood of output died so, one time in a
    few on a loaded machine. The rank ends with ``os._exit``, so nothing needs that
    hook; the user's own atexit handlers still run."""
    try:
        from zmq.utils.garbage import gc as zmq_gc
    except ImportError:
        return
    hook = getattr(zmq_gc, "_atexit", None)  # (a private name of pyzmq)
    if hook is not None:
        atexit.unregister(hook)
