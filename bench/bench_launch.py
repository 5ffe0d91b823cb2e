"""What ``gpusd launch`` adds to plain ssh: start-to-exit time of a trivial command on 2 and 4 namespace
hosts (tests/netns.py, an sshd per host from tests/sshd.py), against one ``ssh HOST true`` per host
started in parallel by the shell (the floor: what any SSH-based launcher pays), and against pdsh-style
sequential ssh.  Root only (namespaces).  Prints a table; nothing leaves the namespaces.

    python bench/bench_launch.py --runs 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from netns import Lan, unavailable  # noqa: E402
from sshd import SshFleet  # noqa: E402
from sshd import unavailable as ssh_unavailable  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    why = unavailable() or ssh_unavailable()
    if why:
        print(f"skipped: {why}")
        return 0
    rows = []
    with Lan(tag="bl") as lan:
        client = lan.add_node("client")
        nodes = [lan.add_node(f"h{i}") for i in range(1, 5)]
        # each host imports gpusd from this tree, as a host where gpusd is installed: its part of the job
        # runs under gpusd's guard there (gpusd.engines.jobguard)
        host_env = {f"node-{i}": {"PYTHONPATH": str(REPO / "src")} for i in range(1, 5)}
        with SshFleet(lan, [(n, f"node-{i}") for i, n in enumerate(nodes, 1)], host_env=host_env) as fleet:
            for count in (2, 4):
                names = [f"node-{i}" for i in range(1, count + 1)]
                pl = fleet.dir / f"placement-{count}.json"
                pl.write_text(json.dumps({"hosts": [{"hostname": n, "address": nodes[i].ip, "gpus": [0]}
                                                    for i, n in enumerate(names)]}))
                env = fleet.env(client)
                cases = {
                    "gpusd launch command -- true": [sys.executable, "-m", "gpusd", "launch", "--placement", str(pl),
                                                     "--no-chdir", "command", "--", "true"],
                    "ssh HOST true, all at once (sh &)": ["sh", "-c", " ".join(
                        f"ssh -F {fleet.config} {n} true &" for n in names) + " wait"],
                    "ssh HOST true, one after another": ["sh", "-c", "; ".join(
                        f"ssh -F {fleet.config} {n} true" for n in names)],
                }
                for label, argv in cases.items():
                    times = []
                    for _ in range(args.runs):
                        t = time.perf_counter()
                        r = lan.run(client, argv, env=env, timeout=60)
                        times.append(time.perf_counter() - t)
                        assert r.returncode == 0, r.stderr
                    rows.append((count, label, statistics.median(times) * 1000, max(times) * 1000))
    print(f"| hosts | how | median ms | slowest ms |  ({args.runs} runs each)")
    print("|---|---|---|---|")
    for count, label, med, worst in rows:
        print(f"| {count} | {label} | {med:.0f} | {worst:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
