"""Benchmark 2: CPU optimizer step throughput.

params/s of the optimizer the runtime uses with offload (DeepSpeedCPUAdam), against
torch's fused AdamW and against a memory-bandwidth bound measured in the same run:
an fp32 Adam step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
exp_avg_sq, 28 bytes per parameter. Target: at least the faster of the two
optimizers (ratio vs best >= 1.0 within noise).
"""

from __future__ import annotations

import argparse

import torch

from spillway_runtime.probe import _time_best as best_of


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n = int(args.params)

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def optimizer_rate(make) -> float:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        opt = make([p])
        opt.step()  # allocate state outside the timing
        return n / best_of(opt.step, args.repeats)

    ds = optimizer_rate(lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3))
    fused = optimizer_rate(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    unfused = optimizer_rate(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))

    # Streaming bandwidth: the best of copy, triad and read over 4n floats (well past the caches).
    a, b, c = torch.randn(4 * n), torch.randn(4 * n), torch.empty(4 * n)
    size = a.numel() * 4
    bandwidth = max(
        2 * size / best_of(lambda: c.copy_(a), args.repeats),
        3 * size / best_of(lambda: torch.add(a, b, alpha=0.5, out=c), args.repeats),
        size / best_of(a.sum, args.repeats),
    )
    bound = bandwidth / 28

    best = max(ds, fused)
    print(f"params: {n:,}  threads: {torch.get_num_threads()}")
    print(f"memory bandwidth (best of torch copy/triad/read): {bandwidth / 1e9:.2f} GB/s "
          f"-> Adam bound {bound / 1e9:.2f} G params/s")
    for name, rate in (("DeepSpeedCPUAdam (runtime)", ds), ("torch fused AdamW", fused),
                       ("torch AdamW (for-loop)", unfused)):
        print(f"{name:28s} {rate / 1e9:6.2f} G params/s  {rate / bound:5.2f} of bound  {rate / best:5.2f} of best")
    print(f"RATIO runtime_optimizer / max(DeepSpeedCPUAdam, fused AdamW) = {ds / best:.2f}")
    print(f"RATIO runtime_optimizer / memory-bandwidth bound = {ds / bound:.2f}")


if __name__ == "__main__":
    main()
