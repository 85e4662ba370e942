"""The held-out loss of the weights as they are: the mean over the learned tokens of every
held-out sequence (SFT), or the DPO loss and TRL's eval_ metrics over every held-out pair, all
ranks together. In eval mode and without gradients: nothing training reads is touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spillway_runtime.core.spec import Method, Training
from spillway_runtime.training.data import PackedDataset


def _batches(held_out: PackedDataset, training: Training, world_size: int) -> int:
    batches = -(-len(held_out) // (training.micro_batch_size * world_size))
    return min(batches, training.eval_batches) if training.eval_batches else batches


def _all_reduce(total: Any, world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(total)


def _eval_batches(engine: Any, held_out: PackedDataset, training: Training, rank: int,
                  world_size: int) -> Iterator[dict[str, Any]]:
    """This rank's held-out micro-batches, with the engine in eval mode and no gradients."""
    import torch

    engine.eval()
    try:
        with torch.no_grad():
            for index in range(_batches(held_out, training, world_size)):
                yield held_out.eval_batch(index, rank, world_size, training.micro_batch_size)
    finally:
        engine.train()


def held_out_loss(engine: Any, held_out: PackedDataset, training: Training, rank: int,
                  world_size: int) -> tuple[float, int]:
    """The mean loss over the held-out learned tokens, and their number."""
    import torch

    total = torch.zeros(2, dtype=torch.float64)
    for batch in _eval_batches(engine, held_out, training, rank, world_size):
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        loss = engine(**{k: v.to(engine.device) for k, v in batch.items()}).loss
        if tokens:
            total += torch.tensor([float(loss.float().item()) * tokens, tokens], dtype=torch.float64)
    _all_reduce(total, world_size)
    return (float(total[0] / total[1]) if total[1] else float("nan")), int(total[1])


def held_out_preferences(engine: Any, reference: Any, held_out: PackedDataset, training: Training, method: Method,
                         rank: int, world_size: int) -> tuple[float, int, dict[str, float]]:
    """The held-out DPO loss, the number of pairs, and TRL's metrics (eval_rewards/chosen, ...),
    against `reference` (`dpo.preference_loss`)."""
    import torch

    from spillway_runtime.training.dpo import preference_loss, step_metrics

    stats = torch.zeros(8, dtype=torch.float64)
    for batch in _eval_batches(engine, held_out, training, rank, world_size):
        stats += preference_loss(engine, reference, {k: v.to(engine.device) for k, v in batch.items()},
                                 method.beta, method.dpo_loss)[1].cpu()
    _all_reduce(stats, world_size)
    value = float(stats[1] / stats[0]) if stats[0] else float("nan")
    return value, int(stats[0]), step_metrics(stats, prefix="eval_")
