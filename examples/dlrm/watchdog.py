"""A per-step progress watchdog (the launcher watch is launcher_watch.py).

:class:`StepWatchdog` (``dist.step_timeout_s``): the process-group
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
import json
import logging
import os
import threading
import time
from typing import Iterator, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE = 3  # the watchdog's exit status (torchrun reports it)


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
