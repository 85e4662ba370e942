"""One training process per rank on this machine, with the runtime's exit-code contract.

`python -m spillway_runtime.training.supervisor --processes N --config runtime.json` (plus
`--nnodes --node-rank --master-addr --master-port` on each node of a multi-node job) stands
where torchrun stood, locally and in pods. torchrun's elastic agent answers a SIGTERM by
raising inside itself: it exits 1 whatever the workers do, and kills them 30 s later, so a
stop request could never end in "checkpoint written, exit 75". This supervisor instead
- starts this node's ranks with a static rendezvous (RANK = node rank x processes + local
  rank, WORLD_SIZE, MASTER_ADDR/PORT of rank 0), in its process group so that one killpg
  reaches them all; every node of a job starts at once (pods of one attempt), and rank 0's
  store waits for the others as torchrun's static rendezvous does;
- forwards the first SIGTERM/SIGINT to every rank exactly once and then waits, however
  long their checkpoint takes (a repeated signal is ignored: the ranks are already
  stopping; SIGKILL is the way to abort, and checkpoints are atomic);
- when a rank fails, stops the others (SIGTERM, then SIGKILL after `FAILURE_GRACE_S`: they
  are likely blocked in a collective with the dead rank) and exits with the failure's code;
- exits with one code for the run: a failure's, else 75 if any rank was preempted, else 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training.processes import die_with_parent, exit_status, free_port

FAILURE_GRACE_S = 30.0  # after one rank failed, how long the others get before SIGKILL
POLL_S = 0.2


def combined_exit(codes: list[int]) -> int:
    """One exit code for the run: the first failure's, else 75 if a rank stopped on request, else 0."""
    failures = [c for c in codes if c not in (ExitCode.OK, ExitCode.PREEMPTED)]
    if failures:
        return failures[0]
    return ExitCode.PREEMPTED if ExitCode.PREEMPTED in codes else ExitCode.OK


@dataclass(frozen=True)
class Topology:
    processes: int = 1  # ranks on this node
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # where rank 0 listens
    master_port: int = 0  # 0: any free port (one node only)

    def rank_env(self, local_rank: int) -> dict[str, str]:
        return {**os.environ, "RANK": str(self.node_rank * self.processes + local_rank),
                "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(self.nnodes * self.processes),
                "LOCAL_WORLD_SIZE": str(self.processes), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


class Supervisor:
    def __init__(self, config: Path, topology: Topology):
        self.config = config
        self.topology = topology if topology.master_port else replace(topology, master_port=free_port())
        self.ranks: list[subprocess.Popen[bytes]] = []
        self.stop_requested = False
        self.signalled: set[int] = set()  # pids that have had their one SIGTERM

    def _on_signal(self, _signum: int, _frame: Any) -> None:
        self.stop_requested = True
        self._forward_stop()

    def _forward_stop(self) -> None:
        for proc in self.ranks:
            if proc.pid not in self.signalled and proc.poll() is None:
                self.signalled.add(proc.pid)
                proc.send_signal(signal.SIGTERM)

    def _codes(self) -> list[int]:
        return [exit_status(p.returncode, p.pid in self.signalled) for p in self.ranks if p.returncode is not None]

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        command = [sys.executable, "-m", "spillway_runtime", "--config", str(self.config)]
        for local_rank in range(self.topology.processes):
            self.ranks.append(subprocess.Popen(command, env=self.topology.rank_env(local_rank),
                                               preexec_fn=die_with_parent))
        if self.stop_requested:  # a request that arrived while the ranks were starting
            self._forward_stop()
        failed_at: float | None = None
        while any(proc.poll() is None for proc in self.ranks):
            if failed_at is None and combined_exit(self._codes()) not in (ExitCode.OK, ExitCode.PREEMPTED):
                failed_at = time.monotonic()  # the others may be blocked in a collective with it
                self._forward_stop()
            elif failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                for proc in self.ranks:
                    if proc.poll() is None:
                        proc.kill()
            time.sleep(POLL_S)
        return combined_exit(self._codes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillway_runtime.training.supervisor")
    parser.add_argument("--config", required=True, type=Path, help="RuntimeConfig JSON written by the launcher")
    parser.add_argument("--processes", required=True, type=int, help="Training processes (ranks) on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="Nodes of the job, each with --processes ranks")
    parser.add_argument("--node-rank", type=int, default=0, help="This node's index, 0 .. nnodes-1")
    parser.add_argument("--master-addr", default="127.0.0.1", help="Address of node 0, where rank 0 listens")
    parser.add_argument("--master-port", type=int, default=0, help="Port of rank 0 (required with --nnodes > 1)")
    args = parser.parse_args(argv)
    problem = None
    if args.processes < 1 or args.nnodes < 1:
        problem = "--processes and --nnodes must be at least 1"
    elif not 0 <= args.node_rank < args.nnodes:
        problem = f"--node-rank must be in 0..{args.nnodes - 1}"
    elif args.nnodes > 1 and not args.master_port:
        problem = "--master-port is required with --nnodes > 1 (every node must name the same one)"
    if problem:
        print(problem, file=sys.stderr)
        return ExitCode.FAILED
    topology = Topology(args.processes, args.nnodes, args.node_rank, args.master_addr, args.master_port)
    code = Supervisor(args.config, topology).run()
    # Keep the exit code whatever arrives during interpreter shutdown (Python restores the
    # default action, death by signal, for handlers it installed).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
