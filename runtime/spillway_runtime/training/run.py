"""What the recipe's parts (`checkpointing`, `mirroring`, `exporting`) see of the run they belong to
(`TrainingRun`, which `recipe.FineTuneRecipe` is), and how the run stops on purpose (`RunFailed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from spillway_runtime.core.contract import ExitCode

if TYPE_CHECKING:
    from types import ModuleType

    from spillway_runtime.core.planner import OffloadPlan
    from spillway_runtime.core.spec import FineTuneJobSpec
    from spillway_runtime.training.reporting import Reporter
    from spillway_runtime.training.runconfig import RuntimeConfig
    from spillway_runtime.training.schedule import DivergencePolicy, EarlyStopping


class RunFailed(RuntimeError):
    """The run cannot go on: a message that names what to change, and the exit code the
    training process ends with (`__main__`)."""

    def __init__(self, message: str, exit_code: int = ExitCode.FAILED):
        super().__init__(message)
        self.exit_code = exit_code


class TrainingRun(Protocol):
    """What the checkpoints read of the run they belong to (`recipe.FineTuneRecipe`), and the
    progress a resume restores into it (`_restore_progress`)."""

    cfg: RuntimeConfig
    spec: FineTuneJobSpec
    plan: OffloadPlan
    rank: int
    world_size: int
    engine: Any  # DeepSpeed's engine (DeepSpeed ships no types)
    reporter: Reporter
    ranks: Ranks
    divergence: DivergencePolicy
    early_stopping: EarlyStopping | None
    # Where training is: what a checkpoint holds beyond DeepSpeed's own state
    step: int
    data_position: int
    skip_ranges: list[tuple[int, int]]
    rollbacks: int
    lr_scale: float
    last_saved_step: int
    last_eval: tuple[int, float] | None
    zenflow_interval: int  # offload.overlap zenflow: its update interval (0: off)
    tokenizer: Any  # transformers' (untyped)
    torch_dtype: Any  # the training dtype, a torch.dtype

    @property
    def torch(self) -> ModuleType: ...

    def log(self, message: str) -> None: ...


class Ranks:
    """The run's processes together (torch.distributed: gloo on the CPU, NCCL on GPUs): every
    rank calls each method at the same point and gets the same answer. With one process, the
    value itself, and torch.distributed is never touched."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def first_failure(self, value: str | None) -> str | None:
        """The first rank's failure (a message), None when no rank failed."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return next((v for v in gathered if v is not None), None)

    def mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t.item()) / self.world_size

    def any(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        import torch

        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        torch.distributed.all_reduce(t)
        return bool(t.item())
