"""Run a benchmark where bytes cost time: its ranks inside a network namespace whose loopback is shaped.

On one box gloo's loopback moves gigabytes per second for little more than the CPU it takes, so a
plan that sends fewer bytes gains little in step time. A token bucket (``tc qdisc ... tbf``) on the
loopback of a fresh user + network namespace (``unshare -Urn``, no root needed) makes every byte
the ranks send cost time: an all-to-all of T bytes in all takes about T / RATE, as on a shared
network of that bandwidth. A benchmark's ``main`` re-execs itself (``python -m MODULE ARGS``, the
same arguments) under :func:`shaped_command`; :data:`ENV` marks the process inside, which runs at
:func:`current_rate` instead of starting another namespace. Nothing outside the namespace is
reachable from inside (no package index): fine for a benchmark, whose imports are installed.
With W ranks sending at once each sees about RATE / W.

Needs ``unshare`` (util-linux), ``ip`` and ``tc`` (iproute2) and user namespaces enabled;
:func:`unavailable` says what is missing, :class:`ShapingUnavailable` carries it.

A benchmark takes ``--network RATE [RATE ...]`` and ``--measure-network`` with :func:`add_arguments`, reads
them with :func:`rates_to_run` (every refusal before any rank starts) and runs its rates with
:func:`run_rates`: each shaped rate in its own process, in its namespace, writing under :func:`rate_dir`, the
results of all rates merged into one file. Its ranks plan for the network they measure where asked
(:data:`MEASURE`, :func:`resolve_network`); each result records the rate and the measurement
(:func:`network_record`) and the reports show them (:func:`networked`, :func:`network_tag`, :func:`network_table`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

ENV = "TORCHREC_HYBRID_SHAPED_RATE"  # set inside the namespace: its loopback's rate
UNSHAPED = "unshaped"
UNSHAPED_NAMES = (UNSHAPED, "none")
# the token bucket: 512 kB bursts, packets queued at most 100 ms (as /work/shared/netem/shaped)
TBF = "tbf rate {rate} burst 512kb latency 100ms"
TOOLS = {"unshare": "util-linux", "ip": "iproute2", "tc": "iproute2"}
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # tc's SI bit rates
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(" + "|".join(_UNITS) + r")$")
# the namespace's set-up; "$0" is the rate, "$@" the command run inside once the loopback is shaped
_SCRIPT = (
    'ip link set lo up || { echo "could not bring up the namespace loopback (ip link set lo up)" >&2; exit 97; }\n'
    'tc qdisc add dev lo root ' + TBF.format(rate='"$0"') + ' || '
    '{ echo "could not shape the loopback (tc qdisc add dev lo root tbf rate $0)" >&2; exit 97; }\n'
    f'export {ENV}="$0" GLOO_SOCKET_IFNAME=lo\n'
    'exec "$@"\n')


class ShapingUnavailable(RuntimeError):
    """No shaped loopback here: a tool is missing or the namespace / qdisc could not be made."""


def parse_rate(flag: str, text: str) -> str:
    """``text`` as a rate for ``flag``: tc's spelling, lower case (``2gbit``, ``500mbit``, ``1.5gbit``), or
    :data:`UNSHAPED` for ``unshaped`` / ``none``. ValueError naming the flag and the value otherwise."""
    rate = str(text).strip().lower()
    if rate in UNSHAPED_NAMES:
        return UNSHAPED
    m = _RATE.match(rate)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{flag} {text!r}: expected a rate as tc reads it, a number > 0 with a unit of "
                         f"{'/'.join(_UNITS)} (e.g. 500mbit, 2gbit, 8gbit), or 'unshaped' / 'none'")
    return rate


def rate_bits(rate: str) -> float:
    """Bits per second of a :func:`parse_rate` rate (``inf``: unshaped)."""
    if rate == UNSHAPED:
        return math.inf
    m = _RATE.match(rate)
    if not m:
        raise ValueError(f"rate {rate!r}: not a parsed rate (parse_rate)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def rate_text(bits: float) -> str:
    """A rate in bits per second as tc would spell it, three digits (``3.16gbit``, ``750mbit``)."""
    if math.isinf(bits):
        return UNSHAPED
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _UNITS[unit]:
            return f"{bits / _UNITS[unit]:.3g}{unit}"
    return f"{bits:.3g}bit"


def current_rate() -> Optional[str]:
    """The rate of the shaped namespace this process runs in (set by :func:`shaped_command`'s script), else
    None."""
    rate = os.environ.get(ENV)
    return parse_rate(ENV, rate) if rate else None


def missing_tools() -> List[str]:
    """The tools a shaped loopback needs that are not on PATH, each with the package that has it."""
    return [f"{tool} ({package})" for tool, package in TOOLS.items() if shutil.which(tool) is None]


def shaped_command(rate: str, command: Sequence[str]) -> List[str]:
    """``command`` run inside a fresh user + network namespace whose loopback is shaped to ``rate`` (a shaped
    :func:`parse_rate` rate), with :data:`ENV` and ``GLOO_SOCKET_IFNAME=lo`` set; the set-up exits 97 with a
    message when it fails."""
    if rate == UNSHAPED:
        raise ValueError("shaped_command: an unshaped rate needs no namespace")
    return ["unshare", "-Urn", "bash", "-c", _SCRIPT, rate, *command]


def unavailable(rate: str = "1gbit") -> Optional[str]:
    """Why no loopback can be shaped to ``rate`` here (a missing tool and its package, or the namespace's or
    tc's own error), or None when it can: a namespace is made and shaped once, which takes milliseconds."""
    missing = missing_tools()
    if missing:
        return (f"missing {', '.join(missing)}: install them (e.g. apt-get install iproute2 util-linux) to run "
                "the ranks on a shaped loopback")
    try:
        proc = subprocess.run(shaped_command(rate, ["true"]), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unshare -Urn failed to start: {e}"
    if proc.returncode != 0:
        said = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit code {proc.returncode}"
        hint = ("" if proc.returncode == 97 else " (user namespaces disabled? see sysctl "
                "kernel.unprivileged_userns_clone / user.max_user_namespaces, or a container without CAP_SYS_ADMIN "
                "that forbids unshare)")
        return f"could not make a network namespace with a shaped loopback: {said}{hint}"
    return None


def check_available(flag: str, rate: str) -> None:
    """Raises :class:`ShapingUnavailable` naming ``flag`` and ``rate`` when :func:`unavailable` has a reason."""
    reason = unavailable(rate)
    if reason:
        raise ShapingUnavailable(f"{flag} {rate}: {reason}")


def run_module(rate: str, module: str, argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> int:
    """Runs ``python -m module argv`` (this interpreter) inside a namespace shaped to ``rate``; its exit code.
    Its output goes where this process's does."""
    command = shaped_command(rate, [sys.executable, "-m", module, *argv])
    return subprocess.run(command, env=dict(os.environ if env is None else env)).returncode


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--network RATE [RATE ...]`` and ``--measure-network`` / ``--no-measure-network`` (read them with
    :func:`rates_to_run`)."""
    ap.add_argument("--network", nargs="+", default=[UNSHAPED], metavar="RATE",
                    help="run every workload at each rate: a shaped one (tc's spelling: 500mbit, 2gbit) in a network "
                         "namespace whose loopback is shaped to it, so the ranks' bytes cost time "
                         "(benchmarks/shaped_loopback.py: needs unshare and tc), 'unshaped' on the plain loopback "
                         "(default: unshaped alone); the results of all rates go into one file")
    ap.add_argument("--measure-network", action=argparse.BooleanOptionalAction, default=None,
                    help="measure the network before planning (measure_network) and give both planners the "
                         "measurement (default: on when a --network rate is shaped, for every rate of the run, "
                         "unshaped too; off otherwise, planning for TorchRec's default topology as before)")


def rates_to_run(ap: argparse.ArgumentParser, network: Sequence[str],
                 measure_network: Optional[bool]) -> Tuple[List[str], Optional[str], bool]:
    """The arguments of :func:`add_arguments` read: ``(rates, inside, measure)``. ``rates``: the rates this
    process runs (each once, in the order given; inside a shaped namespace only its own), ``inside``: the rate of
    the namespace this process runs in (None: none), ``measure``: whether the ranks measure the network before
    planning (default: when a rate is shaped). A bad rate, ``--no-measure-network`` with a shaped rate, or a
    shaped rate this machine cannot run (:func:`check_available`: tools, namespace, tc's own reading) stops
    here, through ``ap.error`` (exit 2), before any rank starts."""
    try:
        rates = list(dict.fromkeys(parse_rate("--network", r) for r in network))
        inside = current_rate()  # set: this is a shaped rate's process, in its namespace
    except ValueError as e:
        ap.error(str(e))
    shaped = [r for r in rates if r != UNSHAPED]
    if shaped and measure_network is False:
        ap.error(f"--no-measure-network with --network {' '.join(shaped)}: on a shaped loopback both planners plan "
                 "for the network measured there (drop --no-measure-network, or run unshaped alone)")
    measure = bool(shaped) if measure_network is None else measure_network
    if inside is not None:
        if inside not in rates:
            ap.error(f"{ENV}={inside}: this process runs on a loopback shaped to {inside}, which "
                     f"--network {' '.join(rates)} does not name")
        return [inside], inside, measure
    for rate in shaped:
        try:
            check_available("--network", rate)
        except ShapingUnavailable as e:
            ap.error(str(e))
    return rates, inside, measure


def rate_dir(out: str, rate: str) -> str:
    """Where the run at a shaped ``rate`` (its own process, in its namespace) writes its results under ``--out``."""
    return os.path.join(out, f"network-{rate}")


def out_dir(out: str, inside: Optional[str]) -> str:
    """Where this process writes: ``out``, or inside a shaped namespace its :func:`rate_dir`."""
    return out if inside is None else rate_dir(out, inside)


def run_rates(rates: Sequence[str], inside: Optional[str], module: str, argv: Sequence[str], out: str,
              filename: str, run_here: Callable[[str], Iterable[Dict[str, Any]]],
              save: Callable[[List[Dict[str, Any]]], None]) -> List[Dict[str, Any]]:
    """Every rate's results, in order: a shaped rate (outside its namespace) re-runs ``python -m module argv``
    there (:func:`run_module`), which writes ``rate_dir(out, rate)/filename`` (JSON: that rate's results, a list
    or an object's ``results``); any other rate runs here, ``run_here(rate)`` yielding its results one by one.
    After each rate's results and each result run here, ``save(results so far)`` (the merged file). A shaped run
    that fails raises RuntimeError naming the rate and its exit code."""
    results: List[Dict[str, Any]] = []
    for rate in rates:
        if rate != UNSHAPED and inside is None:  # its ranks in a namespace of its own: the module again, there
            logger.info("--network %s: the ranks on a loopback shaped to %s (%s)", rate, rate, rate_dir(out, rate))
            code = run_module(rate, module, argv)
            if code != 0:
                raise RuntimeError(f"--network {rate}: the shaped run exited with code {code} (its output above); "
                                   f"the rates before it are in {os.path.join(out, filename)}")
            with open(os.path.join(rate_dir(out, rate), filename)) as f:
                data = json.load(f)
            results += data["results"] if isinstance(data, dict) else data
            save(results)
            continue
        for result in run_here(rate):
            results.append(result)
            save(results)
    return results


# ---------------------------------------------------------------- the network a result planned for and ran on


MEASURE = "measure"  # a run's network argument: its ranks measure the network before planning


def resolve_network(network: Any, pg: Any) -> Any:
    """A rank's ``network`` argument as the planners take it: :data:`MEASURE` measured here
    (``torchrec_hybrid.planner.measure_network`` on ``pg``, collective: every rank calls it, after the statistics
    and before planning, and gets the same measurement), anything else (None, a ``NetworkMeasurement``) as is."""
    if network != MEASURE:
        return network
    from torchrec_hybrid.planner import measure_network

    return measure_network(pg)


def network_record(rate: str, measurement: Optional[Any], world: int) -> Dict[str, Any]:
    """What a result records of its network: the loopback's rate asked for (``unshaped``, or tc's spelling and
    bits per second) and the ranks' measurement (None: not measured), its fields as they are and, in Gbit/s
    (the unit of the asked rate), the all-to-all bandwidth per rank, all ranks' together and the all-reduce's."""
    bits = rate_bits(rate)
    out: Dict[str, Any] = {"rate": rate, "rate_bits_per_s": None if math.isinf(bits) else bits, "measured": None}
    if measurement is not None:
        fields = dataclasses.asdict(measurement)
        per_rank = measurement.bandwidth * 8e3 / 1e9  # bytes/ms -> Gbit/s
        out["measured"] = dict(fields, per_rank_gbit_s=per_rank, aggregate_gbit_s=per_rank * world,
                               allreduce_gbit_s=measurement.allreduce_bandwidth * 8e3 / 1e9)
    return out


def networked(results: List[Dict[str, Any]]) -> bool:
    """Whether any result ran on a shaped loopback or planned for a measured network (then the reports say which
    network each row ran on, and add the network, per-rate and crossover tables)."""
    return any(r.get("network", {}).get("rate", UNSHAPED) != UNSHAPED or r.get("network", {}).get("measured")
               for r in results)


def network_tag(results: List[Dict[str, Any]], r: Dict[str, Any]) -> str:
    """`` [2gbit, measured 1.9 Gbit/s all ranks]``: the network result ``r`` ran on, as the terminal summaries say
    it ("" where none of ``results`` is :func:`networked`)."""
    if not networked(results):
        return ""
    n = r.get("network", {})
    m = n.get("measured")
    return f" [{n['rate']}" + (f", measured {gbit(m['aggregate_gbit_s'])} Gbit/s all ranks" if m else "") + "]"


def gbit(x: Optional[float]) -> str:
    """Gbit/s as the network tables print it ("-": unknown)."""
    return "-" if x is None else f"{x:.3g}"


def network_table(results: List[Dict[str, Any]]) -> List[str]:
    """The network each result ran on: the rate asked (``--network``) and what its ranks measured
    (:func:`network_record`), a "## Network" section."""
    lines = ["## Network", "", "The loopback's rate asked for (`--network`; all ranks share it: an all-to-all of T "
             "bytes in all takes about T / rate) and what the ranks measured before planning "
             "(`measure_network`; both planners planned for it), in Gbit/s:", "",
             "| network | workload | W | all-to-all per rank | all ranks | all-reduce per rank | collective ms "
             "| backend |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        n, m = r["network"], r["network"].get("measured")
        if m is None:
            lines.append(f"| {n['rate']} | {r['workload']} | {r['world']} | not measured | - | - | - | - |")
            continue
        lines.append(f"| {n['rate']} | {r['workload']} | {r['world']} | {gbit(m['per_rank_gbit_s'])} | "
                     f"{gbit(m['aggregate_gbit_s'])} | {gbit(m['allreduce_gbit_s'])} | "
                     f"{m.get('collective_ms', float('nan')):.3g} | {m.get('backend', '-')} |")
    return lines
