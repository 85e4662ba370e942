"""What a node probe writes as `spillway.dev/*` annotations reads back as the same
`NodeHardware`, and what does not parse reads as unmeasured, not guessed."""

from typing import Any

import pytest

from spillway_runtime.core.hardware import AioSettings, NodeHardware, hardware_from_node
from spillway_runtime.core.planner import plan_tiers
from spillway_runtime.core.units import GiB
from tests.unit.test_planner import P13, TRAIN, rtx4090


def bare_node(annotations: dict[str, str]) -> dict[str, Any]:
    """A Node object with these annotations and no GPU labels: 16 cores, 64 GiB."""
    return {"metadata": {"name": "n", "annotations": annotations},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}}}


def test_node_hardware_from_labels_and_annotations_round_trips():
    hw = rtx4090(64)
    hw.cpu_adam_params_per_s = 2.0e9
    node = {
        "metadata": {
            "name": "gpu-1",
            "labels": {"nvidia.com/gpu.product": "NVIDIA GeForce RTX 4090", "nvidia.com/gpu.memory": "24564",
                       "nvidia.com/gpu.count": "1"},
            "annotations": hw.to_annotations(),
        },
        "status": {"allocatable": {"nvidia.com/gpu": "1", "cpu": "16", "memory": "64Gi"}},
    }
    back = hardware_from_node(node)
    assert back.gpu_count == 1 and back.gpu_memory_bytes == hw.gpu_memory_bytes
    assert back.cpu_memory_bytes == 64 * GiB
    assert back.nvme_free_bytes == hw.nvme_free_bytes
    assert back.cpu_adam_params_per_s == 2.0e9
    assert plan_tiers(P13, back, TRAIN).label == plan_tiers(P13, hw, TRAIN).label


def test_the_probed_aio_settings_round_trip_through_node_annotations():
    hw = rtx4090(64)
    hw.aio = AioSettings(block_size=8 << 20, queue_depth=128, intra_op_parallelism=4)
    annotations = hw.to_annotations()
    assert annotations["spillway.dev/aio-block-size"] == str(8 << 20)
    assert annotations["spillway.dev/aio-queue-depth"] == "128"
    assert annotations["spillway.dev/aio-intra-op-parallelism"] == "4"
    back = hardware_from_node(bare_node(annotations))
    assert back.aio == hw.aio
    assert plan_tiers(P13, back, TRAIN).aio == hw.aio


def test_the_probed_host_work_round_trips_through_node_annotations_and_junk_reads_as_unmeasured():
    hw = rtx4090(64).model_copy(update={"host_work_scale": 1.8765})
    annotations = hw.to_annotations()
    assert annotations["spillway.dev/host-work-scale"] == "1.877"
    node = bare_node(annotations)
    assert hardware_from_node(node).host_work_scale == 1.877
    for junk in ("fast", "0", "-2", "inf", "nan"):
        annotations["spillway.dev/host-work-scale"] = junk
        assert hardware_from_node(node).host_work_scale is None, junk
    assert "spillway.dev/host-work-scale" not in rtx4090(64).to_annotations()  # the quick probe measures none


def test_the_disks_cost_per_transfer_round_trips_through_node_annotations_and_junk_reads_as_unmeasured():
    hw = rtx4090(64).model_copy(update={"nvme_transfer_seconds": 0.0153})
    annotations = hw.to_annotations()
    assert annotations["spillway.dev/nvme-transfer-microseconds"] == "15300"
    node = bare_node(annotations)
    assert hardware_from_node(node).nvme_transfer_seconds == 0.0153
    for junk in ("slow", "-5", "2000000", "inf", "nan"):  # 2 s is no disk's latency
        annotations["spillway.dev/nvme-transfer-microseconds"] = junk
        assert hardware_from_node(node).nvme_transfer_seconds is None, junk
    assert "spillway.dev/nvme-transfer-microseconds" not in rtx4090(64).to_annotations()
    with pytest.raises(ValueError, match="nvme_transfer_seconds"):
        NodeHardware.model_validate({**rtx4090(64).model_dump(), "nvme_transfer_seconds": 2.0})


def test_a_node_with_part_of_the_aio_annotations_plans_with_the_defaults():
    """Half a measurement is not a setting anyone measured; a garbled value is not one either."""
    annotations = {"spillway.dev/aio-block-size": str(8 << 20), "spillway.dev/aio-queue-depth": "128"}
    for extra in ({}, {"spillway.dev/aio-intra-op-parallelism": "many"},
                  {"spillway.dev/aio-intra-op-parallelism": "0"}):
        assert hardware_from_node(bare_node({**annotations, **extra})).aio is None
    assert "spillway.dev/aio-block-size" not in rtx4090(64).to_annotations()  # the quick probe writes none
