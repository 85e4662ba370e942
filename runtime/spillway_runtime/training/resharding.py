"""Resume across shapes: the number of processes and the placement a checkpoint was written
with (its manifest), against the ones this attempt runs with, and which changes a resume can
convert (through DeepSpeed's universal checkpoint: `Checkpointing._load_resharded`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spillway_runtime.checkpoints.store import CheckpointInfo, CheckpointStore
from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training.run import RunFailed


@dataclasses.dataclass(frozen=True)
class Shape:
    """The number of processes and the placement that a checkpoint was written with, or that
    this attempt runs with."""

    world_size: int
    zero_stage: int
    optimizer: str
    parameters: str
    resident: float = 0.0  # with the optimizer on NVMe, the share of its sub-groups kept in RAM

    @property
    def layout(self) -> tuple[int, int]:
        """What the files' partitioning depends on; where state was offloaded to does not change it."""
        return self.world_size, self.zero_stage

    @property
    def swapped(self) -> tuple[bool, float]:
        """Which sub-groups' state is in swap files rather than in the ZeRO files."""
        return self.optimizer == "nvme", self.resident

    def describe(self) -> str:
        optimizer = self.optimizer
        if self.optimizer == "nvme" and self.resident:
            optimizer = f"nvme with {self.resident:.0%} of its sub-groups in RAM"
        return (f"{self.world_size} process(es), ZeRO-{self.zero_stage}, optimizer on {optimizer}, "
                f"parameters on {self.parameters}")

    def public(self) -> dict[str, Any]:
        return {"worldSize": self.world_size, "stage": self.zero_stage,
                "optimizer": self.optimizer, "parameters": self.parameters, "cpuResidentFraction": self.resident}


def rescaled(position: int, scale: tuple[int, int], what: str) -> int:
    """A count of global micro-batches of `old` processes as one of `new` processes' (same samples)."""
    old, new = scale
    rescaled, left = divmod(position * old, new)
    if left:
        raise RunFailed(
            f"{what} ({position} micro-batches of {old} processes) is not a whole number of micro-batches of "
            f"{new} processes; resume with a number of processes that divides {position * old}",
            ExitCode.BAD_INPUT,
        )
    return rescaled


def written_shape(store: CheckpointStore, info: CheckpointInfo) -> Shape | None:
    """The shape that wrote a checkpoint, from its manifest (None: an older manifest)."""
    from spillway_runtime.core.planner import parse_label

    manifest = store.read_manifest(info.path) or {}
    world, label = manifest.get("worldSize"), manifest.get("plan")
    resident = manifest.get("cpuResidentFraction", 0.0)
    if not isinstance(world, int) or not isinstance(label, str) or not isinstance(resident, int | float):
        return None
    try:
        stage, optimizer, parameters = parse_label(label)
    except ValueError:
        return None
    return Shape(world, stage, optimizer, parameters, float(resident))


def refuse_reshard(info: CheckpointInfo, written: Shape, planned: Shape, lora: bool) -> None:
    """Refused with BAD_INPUT, naming what to change: a change of shape this runtime cannot convert."""
    # The optimizer on NVMe converts both ways (its swap files are read into the universal
    # checkpoint, and a ZeRO-3 engine's are filled from it); parameters on NVMe do not yet.
    on_nvme = [f"{side} parameters" for side, shape in (("written with", written), ("planned with", planned))
               if shape.parameters == "nvme"]
    unsupported = None
    if on_nvme:
        unsupported = f"state on NVMe ({', '.join(on_nvme)} on NVMe)"
    elif lora:
        unsupported = "LoRA (method.lora)"
    if unsupported is not None:
        raise RunFailed(
            f"checkpoint {info.name} was written by {written.describe()} and this attempt runs "
            f"{planned.describe()}; resuming across that change with {unsupported} is not supported "
            "yet: resume with the same number of processes and placement (offload.deepspeed.zero_optimization"
            ".stage, offload.optimizer, offload.parameters, offload.cpuResidentFraction)",
            ExitCode.BAD_INPUT,
        )
