"""Clean exits (issue 58 item 3): the quickstart and the DLRM example, each run many times under
torchrun on 2 ranks; every run must exit 0 with no abort at exit and leave no process behind.

    python -m benchmarks.clean_exits --quickstart 100 --dlrm 30

Per run: the exit code, whether stderr shows an abort ("terminate called", "Aborted", "Fatal
Python error", "core dumped", a signal exit) and how many of its processes (marked through their
environment) are alive 5 s after the launcher returned. Writes ``--out`` (JSON: per kind the counts
and every bad run's stderr tail).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List

import tqdm

from torchrec_hybrid.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ABORTS = ("terminate called", "Aborted", "Fatal Python error", "core dumped", "SIGABRT", "Segmentation fault")
COMMANDS = {
    "quickstart": [os.path.join(REPO, "examples", "quickstart.py")],
    "dlrm": [os.path.join(REPO, "examples", "dlrm", "train.py"), "--config",
             os.path.join(REPO, "configs", "dlrm_tiny.yaml"), "--set", "train.log_level=warning"],
}


def _marked(mark: str) -> List[int]:
    """Live (not zombie) processes whose environment holds ``RUN_MARK=mark``."""
    needle, out = f"RUN_MARK={mark}".encode(), []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(name))
    return out


def run_once(kind: str, index: int, timeout_s: float) -> Dict:
    """One 2-rank run of ``kind``: exit code, abort seen, processes left 5 s after it returned."""
    mark = f"{os.getpid()}-{kind}-{index}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RUN_MARK=mark)
    cmd = [TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           *COMMANDS[kind]]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, err = "timeout", (e.stderr or b"").decode("utf-8", "replace") if isinstance(e.stderr, bytes) else \
            (e.stderr or "")
    seconds = time.time() - t0
    time.sleep(5)
    left = _marked(mark)
    for pid in left:  # leave nothing behind for the next run
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    aborts = [a for a in ABORTS if a in err]
    return {"exit": code, "aborts": aborts, "left": len(left), "seconds": round(seconds, 1),
            "clean": code == 0 and not aborts and not left, "stderr_tail": err[-2000:]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quickstart", type=int, default=100, help="runs of examples/quickstart.py")
    p.add_argument("--dlrm", type=int, default=30, help="runs of the DLRM example (tiny config)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--out", default=os.path.join("out", "clean_exits.json"))
    args = p.parse_args(argv)
    results: Dict[str, Dict] = {}
    for kind, n in (("quickstart", args.quickstart), ("dlrm", args.dlrm)):
        runs = [run_once(kind, i, args.timeout) for i in tqdm.tqdm(range(n), desc=kind, disable=n == 0)]
        bad = [dict(r, run=i) for i, r in enumerate(runs) if not r["clean"]]
        results[kind] = {"runs": n, "clean": n - len(bad), "nonzero_exit": sum(r["exit"] != 0 for r in runs),
                         "aborts": sum(bool(r["aborts"]) for r in runs), "left_processes": sum(r["left"] for r in runs),
                         "median_s": sorted(r["seconds"] for r in runs)[n // 2] if n else None, "bad": bad}
        print(f"{kind}: {results[kind]['clean']}/{n} clean (nonzero exit {results[kind]['nonzero_exit']}, "
              f"aborts {results[kind]['aborts']}, processes left {results[kind]['left_processes']})", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
