"""Bytes a process really sent, counted by the kernel (``wchar`` of ``/proc/self/io``).

With gloo on loopback, ``wchar`` counts exactly what the process writes to its sockets
(an all-to-all of 4 MB per peer on 4 ranks reads 12.0004 MB), so the figure does not depend
on any code under test. It also counts file and terminal writes: measure a window in which
the process neither prints nor logs nor writes files. Linux only; NCCL traffic bypasses it.
"""

from contextlib import contextmanager
from typing import Iterator, List


def sent_bytes() -> int:
    """Total bytes this process has written since it started (``wchar``)."""
    with open("/proc/self/io", "rb") as f:
        for line in f:
            if line.startswith(b"wchar"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


@contextmanager
def count_sent_bytes() -> Iterator[List[int]]:
    """``with count_sent_bytes() as n: ...`` then ``n[0]`` holds the bytes sent inside."""
    box = [0]
    start = sent_bytes()
    try:
        yield box
    finally:
        box[0] = sent_bytes() - start
