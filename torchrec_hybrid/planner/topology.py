"""Topologies for the planner on CPU/gloo clusters.

TorchRec's default bandwidths describe NVLink + a NIC per GPU (all-to-all 600 GB/s inside a
host, all-reduce 12.5 GB/s x local ranks). With gloo every collective goes through the
same TCP sockets, so one bandwidth for all of them (``UniformCommsBandwidth``) is the honest
model there; it also makes the planner's step cost proportional to the bytes it predicts.
"""

from __future__ import annotations

from typing import Optional

from torchrec.distributed.planner.types import CollectiveType, GeneralizedCommsBandwidth, Topology

GB = 1024 ** 3
DEFAULT_GLOO_BW_GBPS = 1.0  # loopback TCP through gloo, order of magnitude


class UniformCommsBandwidth(GeneralizedCommsBandwidth):
    """The same bandwidth (bytes/ms) for every collective, inside or across hosts."""

    def __init__(self, bw: float) -> None:
        if bw <= 0:
            raise ValueError(f"bandwidth must be > 0, got {bw}")
        self.name = "UniformCommsBandwidth"
        self._bw = float(bw)

    @property
    def intra_host_bw(self) -> float:
        return self._bw

    @property
    def inter_host_bw(self) -> float:
        return self._bw

    def get_bw(self, local_world_size: int, world_size: int, collective_type: CollectiveType) -> float:
        return self._bw

    def __str__(self) -> str:
        return f"{self.name}: bw={self._bw}"

    def __hash__(self) -> int:
        return hash((self.name, self._bw))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UniformCommsBandwidth) and other._bw == self._bw


def gbps_to_bytes_per_ms(gbps: float) -> float:
    return gbps * GB / 1000.0


def gloo_topology(world_size: int, bandwidth_gbps: float = DEFAULT_GLOO_BW_GBPS,
                  local_world_size: Optional[int] = None, **kwargs) -> Topology:
    """A CPU topology whose collectives all run at ``bandwidth_gbps`` (GiB/s)."""
    return Topology(world_size=world_size, compute_device="cpu", local_world_size=local_world_size,
                    generalized_comms_bandwidths=UniformCommsBandwidth(gbps_to_bytes_per_ms(bandwidth_gbps)),
                    **kwargs)
