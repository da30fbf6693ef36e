"""The frequency statistics file: one ``torch.save`` of a statistics state plus a content checksum.

`FrequencyStats.save` and `FrequencyStats.load` go through here. The write is atomic (a temporary
file renamed into place); a read fails with a `StatsFileError` that names the path and what is wrong
(a directory, not a torch file, truncated, a checksum mismatch, a state its schema refuses). What a
state holds is `FrequencyStats.state_dict`'s; its schema checks are in validation.py.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Callable, Dict, TypeVar, Union

import torch

T = TypeVar("T")


class StatsFileError(ValueError):
    """A statistics file is not one, is damaged, or does not match its schema."""


def state_checksum(state: Any) -> int:
    """CRC32 of a state's content (dict keys in sorted order; tensors by dtype, shape, bytes)."""
    crc = 0

    def walk(x: Any) -> None:
        nonlocal crc
        if isinstance(x, dict):
            crc = zlib.crc32(b"{", crc)
            for k in sorted(x, key=str):
                if k == "checksum":
                    continue
                crc = zlib.crc32(repr(k).encode(), crc)
                walk(x[k])
            crc = zlib.crc32(b"}", crc)
        elif isinstance(x, (list, tuple)):
            crc = zlib.crc32(b"[", crc)
            for v in x:
                walk(v)
            crc = zlib.crc32(b"]", crc)
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            crc = zlib.crc32(f"T{t.dtype}{tuple(t.shape)}".encode(), crc)
            crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"", crc)
        else:
            crc = zlib.crc32(repr(x).encode(), crc)

    walk(state)
    return crc


def write_stats_file(state: Dict[str, Any], path: Union[str, os.PathLike]) -> None:
    """Write a state to one file: torch.save of it plus its checksum.

    Written to a temporary file beside `path` and renamed into place, so `path` is
    either the old file or the complete new one, never a partial write.
    """
    state = {**state, "checksum": state_checksum(state)}
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_stats_file(path: Union[str, os.PathLike], build: Callable[[Dict[str, Any]], T]) -> T:
    """``build(state)`` of the state in a file written by `write_stats_file`.

    Raises FileNotFoundError for a missing path and `StatsFileError` (a ValueError)
    naming the path for a file that is not a statistics file, is truncated or corrupt
    (checksum mismatch), or whose state ``build`` refuses with a ValueError.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"statistics file {path!r} does not exist")
    if os.path.isdir(path):
        raise StatsFileError(f"statistics file {path!r} is a directory, not a file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip, EOF errors...: all mean "not a readable file"
        size = os.path.getsize(path)
        detail = (str(e).strip().splitlines() or [""])[0]
        if detail.startswith("Weights only load failed"):  # torch's advice does not apply here
            detail = "unreadable pickle data"
        detail = detail.split(". This is an internal miniz error")[0][:160]
        raise StatsFileError(
            f"{path!r} ({size} bytes) is not a frequency statistics file, or it is truncated or "
            f"corrupt: torch.load failed with {type(e).__name__}" + (f": {detail}" if detail else "")
        ) from e
    if not isinstance(state, dict) or "format_version" not in state:
        what = (f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict)
                else f"a {type(state).__name__}")
        raise StatsFileError(f"{path!r} is not a frequency statistics file: it holds {what}, "
                             "without a 'format_version'")
    if "checksum" in state:  # files from before checksums have none
        stored = state.pop("checksum")
        actual = state_checksum(state)
        if stored != actual:
            raise StatsFileError(f"{path!r} is corrupt: its content checksum is {actual}, "
                                 f"the file records {stored!r}")
    try:
        return build(state)
    except ValueError as e:
        raise StatsFileError(f"{path!r}: {e}") from e
