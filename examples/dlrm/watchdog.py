"""Workers that do not outlive their launcher, and a per-step progress watchdog.

**Launcher death** (:func:`exit_with_launcher`). A torchrun worker is a child of the torchrun
agent. When the agent is SIGKILLed it cannot forward a signal, and without help the workers
train on as orphans. Two mechanisms, because each alone has a hole:

- ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (Linux, through ctypes): the kernel sends SIGTERM when
  the parent goes away. The signal is tied to the *thread* that forked the worker (torchrun's
  main thread: ``subprocess.Popen`` in the agent), and it is lost if the parent died before the
  call;
- so a daemon thread also polls ``os.getppid()`` once a second: a worker re-parented (to init
  or a subreaper) sends itself the same SIGTERM. This covers the race at start, other
  launchers and non-Linux systems.

SIGTERM is what torchrun itself sends to stop a job, so an orphaned worker stops the same
way: every rank stops at the next step boundary, checkpointing first (``checkpoint.on_signal``),
and exits. If a worker is still there ``grace_s`` seconds later (a rank stuck in a collective),
it exits hard (``os._exit``).

**Progress watchdog** (:class:`StepWatchdog`, ``dist.step_timeout_s``). The process-group
timeout (``dist.timeout_s``) must be long enough for the slowest collective of the run (a large
checkpoint, a validation pass, the start-up), so a stopped peer (SIGSTOP, a hung host) would
keep the others waiting that long. The watchdog measures only the training steps: a daemon
thread checks that the main loop passes a step boundary at least every ``step_timeout_s``
seconds (checkpoint writes and validation passes pause it, the process-group timeout covers
them). Each rank's thread also writes a heartbeat ``{step, time}`` to the job's TCP store every
second, so when a rank's step times out it names the peers that stopped beating (stopped or
dead) or are behind, logs one error line and exits; torchrun then ends the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterator, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_CODE = 3  # the watchdog's exit status (torchrun reports it)


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_launcher(sig: int = signal.SIGTERM, grace_s: float = 60.0, poll_s: float = 1.0) -> None:
    """The calling worker gets ``sig`` when its launcher (parent process) dies; ``grace_s`` later
    it exits hard if it has not stopped. Call it after the ``sig`` handler is installed."""
    parent = os.getppid()
    _set_parent_death_signal(sig)

    def orphaned() -> None:
        logger.error("the launcher (pid %d) is gone: stopping this worker (%s), hard exit in %.0f s",
                     parent, signal.Signals(sig).name, grace_s)
        os.kill(os.getpid(), sig)
        time.sleep(grace_s)
        logger.error("the launcher (pid %d) is gone and this worker did not stop within %.0f s: exiting",
                     parent, grace_s)
        os._exit(EXIT_CODE)

    if parent == 1:  # already orphaned (or started by init): nothing to watch
        return

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        orphaned()

    threading.Thread(target=poll, name="launcher-watch", daemon=True).start()


class StepWatchdog:
    """Ends this worker with an error naming the stuck peers when a step takes longer than
    ``timeout_s`` (0: off). ``beat(step)`` at every step boundary, ``paused()`` around the
    long collectives that the process-group timeout covers."""

    def __init__(self, timeout_s: float, rank: int, world: int, interval_s: float = 1.0) -> None:
        self.timeout_s, self.rank, self.world, self.interval_s = float(timeout_s), rank, world, interval_s
        self.step = 0
        self._last = time.monotonic()
        self._armed = False
        self._stopped = threading.Event()
        self._store = None
        self._prefix = "dlrm_watchdog/{}/{}/".format(os.environ.get("TORCHELASTIC_RUN_ID", "run"),
                                                     os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._thread: Optional[threading.Thread] = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0

    def start(self, step: int) -> None:
        if not self.enabled:
            return
        if self._store is None:
            try:  # the process group's store (TCPStore serialises its calls); a second client of
                # our own was seen to abort at exit ("terminate called without an active exception")
                self._store = dist.distributed_c10d._get_default_store()
            except Exception as e:  # noqa: BLE001 - heartbeats are a diagnostic, never fatal
                logger.warning("step watchdog: no heartbeats (cannot reach the store: %s)", e)
        self.beat(step)
        self._heartbeat()
        self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int) -> None:
        self.step = step
        self._last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        armed, self._armed = self._armed, False
        try:
            yield
        finally:
            self._last = time.monotonic()
            self._armed = armed

    def stop(self) -> None:
        """Disarms and ends the thread (joined: no store call may outlive the process group)."""
        self._armed = False
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._store = None

    def _key(self, rank: int) -> str:
        return f"{self._prefix}hb{rank}"

    def _heartbeat(self) -> None:
        if self._store is None:
            return
        try:
            self._store.set(self._key(self.rank), json.dumps({"step": self.step, "t": time.time()}))
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher
            pass

    def _peers(self) -> str:
        """What the other ranks' heartbeats say: stopped beating, behind, or alive."""
        if self._store is None:
            return "peers unknown (no store)"
        parts = []
        now = time.time()
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                if not self._store.check([self._key(r)]):
                    parts.append(f"rank {r} is not responding (no heartbeat at all: stopped or hung)")
                    continue
                hb = json.loads(self._store.get(self._key(r)))
            except Exception as e:  # noqa: BLE001
                parts.append(f"rank {r}: unknown ({type(e).__name__})")
                continue
            age = now - hb["t"]
            if age > max(3.0, 3 * self.interval_s):
                parts.append(f"rank {r} is not responding (no heartbeat for {age:.1f} s, last at step "
                             f"{hb['step']}: stopped or hung)")
            elif hb["step"] < self.step:
                parts.append(f"rank {r} is alive but behind (at step {hb['step']})")
            else:
                parts.append(f"rank {r} is alive at step {hb['step']}")
        return "; ".join(parts)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self._heartbeat()
            waited = time.monotonic() - self._last
            if self._armed and waited > self.timeout_s:
                msg = (f"step watchdog: rank {self.rank} made no progress for {waited:.1f} s in step "
                       f"{self.step + 1} (dist.step_timeout_s={self.timeout_s:g}); {self._peers()}; exiting")
                logger.error("%s", msg)
                for h in logging.getLogger().handlers:
                    h.flush()
                os._exit(EXIT_CODE)
