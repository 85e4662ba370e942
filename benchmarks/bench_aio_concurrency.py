"""Benchmark: does this disk read and write faster at once than one after the other?

DeepSpeed's pipelined optimizer swapper reads sub-group i+1 while it writes sub-group i-1,
on two async I/O handles. The planner times that phase with the probe's serial read and
write rates. If the disk served a read and a write together faster than in turn, the
planner would under-predict the pipelined swap. This times the same locked buffers with
DeepSpeed's own aio op, both ways, in one run (best of 3 each), and prints the
concurrent/serial time ratio: below 1 means the overlap gains bandwidth.

    DS_ACCELERATOR=cpu python benchmarks/bench_aio_concurrency.py [MiB ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from deepspeed.ops.op_builder import AsyncIOBuilder

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import BENCH_DIR

from spillway_runtime.probe import _time_best as best_of

REPEATS = 3


def measure(directory: Path, mib: int) -> str:
    aio = AsyncIOBuilder().load()
    # block size, queue depth, single submit, overlap events, threads: DeepSpeed's defaults
    reader, writer = (aio.aio_handle(1 << 20, 32, False, True, 1) for _ in range(2))
    size = mib << 20
    a = reader.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    b = writer.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    a.view(torch.int64).random_()
    b.view(torch.int64).random_()
    fa, fb = str(directory / "read.swp"), str(directory / "write.swp")
    for tensor, path in ((a, fa), (b, fb)):
        writer.pwrite(tensor, path, False, True)
        writer.wait()

    def both() -> None:
        reader.pread(a, fa, False, True)
        writer.pwrite(b, fb, False, True)
        reader.wait()
        writer.wait()

    w = best_of(lambda: (writer.pwrite(b, fb, False, True), writer.wait()), REPEATS)
    r = best_of(lambda: (reader.pread(a, fa, False, True), reader.wait()), REPEATS)
    c = best_of(both, REPEATS)
    os.remove(fa)
    os.remove(fb)
    return (f"{mib} MiB: write {size / w / 1e6:.0f} MB/s, read {size / r / 1e6:.0f} MB/s, "
            f"read then write {2 * size / (r + w) / 1e6:.0f} MB/s, both at once {2 * size / c / 1e6:.0f} MB/s; "
            f"concurrent/serial time {c / (r + w):.2f} (load {os.getloadavg()[0]:.1f})")


def main() -> None:
    directory = BENCH_DIR / "aio-concurrency"
    directory.mkdir(parents=True, exist_ok=True)
    for mib in [int(x) for x in sys.argv[1:]] or [64, 256]:
        print(measure(directory, mib))


if __name__ == "__main__":
    main()
