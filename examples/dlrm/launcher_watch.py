"""Workers that do not outlive their launcher, from their first line on (standard library only, so
``train.py`` starts the watch before its seconds of imports).

A torchrun worker is a child of the torchrun agent. When the agent is SIGKILLed it cannot forward a
signal, and without help the workers go on as orphans: a worker still importing, or waiting for the
agent's store in ``init_process_group``, would wait there for minutes. Two mechanisms, because
each alone has a hole:

- ``prctl(PR_SET_PDEATHSIG, sig)`` (Linux, through ctypes): the kernel sends ``sig`` when the parent
  goes away, whatever the worker is doing. It is tied to the *thread* that forked the worker and is
  lost if the parent died before the call;
- so a daemon thread also polls ``os.getppid()`` every ``poll_s``: a worker re-parented (to init or
  a subreaper) acts as below. This covers other launchers and non-Linux systems.

Two phases. **Start-up** (:func:`watch_launcher`, until :func:`stop_gracefully`): nothing is trained
yet, so an orphaned worker ends at once: SIGKILL from the kernel (no handler, no GIL needed, even
inside a C call), or ``os._exit`` from the poll. **Training**: SIGTERM (what torchrun itself sends
to stop a job), so every rank stops at the next step boundary, checkpointing first; if the worker
is still there ``grace_s`` later (a rank stuck in a collective), it exits hard. A worker whose
parent is init from its first line (the launcher died before it, or is PID 1 in a container)
cannot tell, and is not polled.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_CODE = 3  # an orphaned worker's exit status


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _Watch:
    """The watch's state: the launcher's pid and, once training, how to stop (None: exit at once)."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self.sig: Optional[int] = None
        self.grace_s = 0.0

    def orphaned(self) -> None:
        if self.sig is None:  # start-up: one write (ranks share the launcher's stderr), then out
            sys.stderr.write(f"[rank{os.environ.get('RANK', '?')}] ERROR: the launcher (pid {self.parent}) is gone "
                             "during start-up: exiting\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)
        logger.error("the launcher (pid %d) is gone: stopping this worker (%s), hard exit in %.0f s",
                     self.parent, signal.Signals(self.sig).name, self.grace_s)
        os.kill(os.getpid(), self.sig)
        time.sleep(self.grace_s)
        logger.error("the launcher (pid %d) is gone and this worker did not stop within %.0f s: exiting",
                     self.parent, self.grace_s)
        os._exit(EXIT_CODE)


_watch: Optional[_Watch] = None


def watch_launcher(poll_s: float = 0.25) -> None:
    """From now on this worker ends when its launcher (parent process) dies: at once during start-up,
    by ``stop_gracefully``'s signal once that is called. Idempotent."""
    global _watch
    if _watch is not None:
        return
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGKILL)
    watch = _watch = _Watch(parent)
    if parent == 1:  # started by init (or orphaned before this line): nothing to poll
        return

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        watch.orphaned()

    threading.Thread(target=poll, name="launcher-watch", daemon=True).start()


def stop_gracefully(sig: int = signal.SIGTERM, grace_s: float = 60.0) -> None:
    """Training has begun: an orphaned worker now sends itself ``sig`` (every rank stops at the next step,
    checkpointing first) and exits hard ``grace_s`` later. Call it after the ``sig`` handler is installed;
    a no-op without :func:`watch_launcher`."""
    if _watch is not None:
        _watch.grace_s = float(grace_s)
        _watch.sig = sig
        _set_parent_death_signal(sig)
