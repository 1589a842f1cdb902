"""A process that used osp exits cleanly: osp's exit hook.

Why: torch 2.13's Gloo worker threads drop their reference to a finished collective a moment after
its ``wait()`` returns. When that was the last reference to a tensor whose Python object is already
gone (a temporary bucket view, or anything the interpreter frees while it finalizes), the worker
takes the GIL to free it; during finalization that ends the thread with a forced unwind through a
``noexcept`` destructor, and ``std::terminate`` kills the process with SIGABRT ("terminate called
without an active exception") after the script's work was done. The launcher then reports a failed
job (and ``torchrun --max-restarts`` restarts it). PyTorch's own atexit fix was abandoned upstream.

What: the first time osp makes a ``Comm``, it registers one ``atexit`` hook. While the interpreter
is still whole, the hook

1. waits for osp's own collectives still in flight (OSP's stage 2, BSP's buckets): every rank issued
   them, so on a healthy job they complete; all of them together may take ``OSP_EXIT_TIMEOUT``
   seconds (default 60), and a failed or late one stops the teardown with a warning;
2. destroys torch.distributed's process groups if the script did not, and lets go of the groups osp
   made itself (OSP's second group, which an optimizer still alive at exit holds): their destructors
   drain the work queues and join the worker threads with the GIL released, so no thread is left to
   take the GIL later. This too is bounded by the same deadline.

Horovod registers ``hvd.shutdown()`` at ``hvd.init()``; that hook runs after osp's (atexit runs
hooks in reverse order), once osp's collectives are complete.

Nothing is torn down when the interpreter exits because of an uncaught exception: a peer may be gone,
and a failing process should leave promptly.

Opt out with ``OSP_EXIT_HOOK=0`` in the environment or :func:`disable` (e.g. when your own atexit
hook still needs the process group: atexit hooks registered before osp's first ``Comm`` run after
it). Nothing here changes what a step computes.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import types
import warnings
import weakref
from typing import Dict

# the communicators with collectives in flight (held until those complete): each ``osp.comm.Comm`` tells
# ``busy`` / ``idle`` and offers ``pending()``, ``wait()``, ``active()`` and ``forget_pending()``
_busy: Dict[int, object] = {}
# the communicators of process groups osp made itself (OSP's second group for stage 2): the optimizer that holds
# one may outlive the script's last line, so at exit each drops its group (``release_group()``)
_made: "weakref.WeakSet" = weakref.WeakSet()
_registered = False
_disabled = False


def _env_timeout() -> float:
    raw = os.environ.get("OSP_EXIT_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        warnings.warn(f"osp: OSP_EXIT_TIMEOUT must be a positive number of seconds, got {raw!r}; using 60",
                      RuntimeWarning, stacklevel=2)
        return 60.0
    return value


def register() -> None:
    """Register the exit hook once per process (called when osp makes a ``Comm``)."""
    global _registered
    if _registered or os.environ.get("OSP_EXIT_HOOK", "1") == "0":
        return
    atexit.register(_at_exit)
    _registered = True


def disable() -> None:
    """Do not tear anything down at exit (the hook stays registered and does nothing)."""
    global _disabled
    _disabled = True


def busy(comm) -> None:
    """``comm`` started a collective nobody has waited for yet."""
    _busy[id(comm)] = comm


def idle(comm) -> None:
    """Every collective ``comm`` started has completed."""
    _busy.pop(id(comm), None)


def pending() -> int:
    """How many collectives osp started are in flight, over every communicator."""
    return sum(len(c.pending()) for c in list(_busy.values()))


def made_group(comm) -> None:
    """``comm`` runs on a process group osp created: at exit, once the groups are destroyed, it lets go of it."""
    _made.add(comm)


def forget(comm) -> None:
    """``comm``'s engine was restarted (Horovod Elastic's reset): its collectives in flight are gone
    with it, and nobody may wait for them at exit."""
    for c in list(_busy.values()):
        if type(c) is type(comm):  # every Comm of a kind runs on the one engine of the process
            c.forget_pending()


def _exiting_on_exception() -> bool:
    # set by the interpreter's handler of an uncaught exception (not by SystemExit) before atexit runs
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _at_exit() -> None:
    if _disabled or _exiting_on_exception():
        return
    deadline = time.monotonic() + _env_timeout()
    for comm in list(_busy.values()):
        if not comm.active():  # its engine was shut down, which completed or dropped its work
            continue
        for handle in comm.pending():
            try:
                comm.wait(handle, max(deadline - time.monotonic(), 1e-3), "osp collective at exit")
            except Exception as e:  # a peer failed or stalled: leave the engine alone, exit promptly
                warnings.warn(f"osp: at exit, an in-flight collective did not complete ({e}); the process "
                              "group is left as it is", RuntimeWarning, stacklevel=1)
                _busy.clear()
                return
    _busy.clear()
    _destroy_process_groups(deadline)


def _destroy_process_groups(deadline: float) -> None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return
    if not dist.is_available():
        return
    errors = []

    def destroy():
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            for comm in list(_made):  # destroyed above (or by the script): only osp's reference keeps them
                comm.release_group()
            _made.clear()
            # also when the script destroyed the group itself: the group object must really go
            _drop_stale_defaults(dist.ProcessGroup)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    # a helper thread bounds the wait: the destructors drain collectives the script started and never
    # waited for, which a peer might never match
    t = threading.Thread(target=destroy, name="osp-exit", daemon=True)
    t.start()
    t.join(max(deadline - time.monotonic(), 1e-3))
    if t.is_alive() or errors:
        warnings.warn("osp: at exit, destroying the torch.distributed process group "
                      + (f"failed ({errors[0]})" if errors else "did not finish in time (a collective the "
                         "script started is still waiting for a peer)"), RuntimeWarning, stacklevel=1)


def _drop_stale_defaults(group_type) -> None:
    """torch.distributed.nn.functional (imported by torch.optim, through dynamo) is written with
    ``group=group.WORLD`` defaults: imported after init_process_group, its functions hold the group
    object, so destroying the group never runs its destructor and Gloo's threads outlive the
    interpreter. At exit every group is destroyed and nothing calls them any more: drop those
    defaults, and with them the last references (the destructors join the threads now)."""
    for name, mod in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or mod is None:
            continue
        for fn in list(vars(mod).values()):
            if type(fn) is not types.FunctionType:  # type(), not isinstance: no deprecated __class__ lookups
                continue
            defaults = fn.__defaults__
            if defaults and any(isinstance(d, group_type) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, group_type) else d for d in defaults)
