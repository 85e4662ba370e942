"""The real node made ready for training jobs, once for the tests of this folder: the tiny
model and datasets on a host directory, the node's NVMe and memlock figures as the node
probe writes them, a StorageClass for the bound volumes, and the real operator running the
CPU training image; and the uninterrupted reference run that the interrupted ones are
compared with. Package-scoped: the tests of this folder run on one worker, in one
session (tests/conftest.py's ClusterOnOneWorker), so each is paid once; the other real-node
modules, which run operators of their own, come after this folder's last test."""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from spillway_runtime.core.hardware import MEMLOCK_ANNOTATION, NVME_PATH_ANNOTATION
from spillway_runtime.meta_shape import shape_from_config
from spillway_runtime.tiny import build_tiny_model, write_chat_dataset, write_dataset
from tests.e2e.cluster import REPO_ROOT, Cluster
from tests.e2e.operator_fixtures import running_operator
from tests.e2e.realnode.real_jobs import BAD_LINE, EXAMPLE, MAX_STEPS, RealNode, finished


@pytest.fixture(scope="package")
def real(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    image = cluster.load_images("runtime-cpu")["runtime-cpu"]
    settings = cluster.settings()
    node, label = settings["NODE_NAME"], settings["NODE_LABEL"]
    root = Path("/tmp") / f"spillway-e2e-pods-{secrets.token_hex(4)}"
    root.mkdir(mode=0o755)
    model = build_tiny_model(root / "inputs" / "model")
    data = write_dataset(root / "inputs" / "data" / "arithmetic.jsonl", count=400)
    write_chat_dataset(root / "inputs" / "data" / "arithmetic-chat.jsonl", count=400)
    _preferences_as_parquet(root / "inputs" / "data" / "arithmetic-preferences.parquet")
    lines = data.read_text().splitlines(keepends=True)
    (data.parent / "bad.jsonl").write_text("".join(lines[: BAD_LINE - 1]) + '{"text": "cut off\n' + "".join(lines[BAD_LINE:]))
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (root / "nvme").mkdir()
    (root / "nvme").chmod(0o1777)  # as the chart's node probe leaves its directory
    # What the node probe (its own test) would have written: the NVMe the plan may spill to, and
    # what a pod may lock there (this machine's containers: 8 MiB), under which the plan fits the swap.
    usage = shutil.disk_usage(root)
    annotations = {NVME_PATH_ANNOTATION: str(root / "nvme"), "spillway.dev/nvme-capacity-bytes": str(usage.total),
                   "spillway.dev/nvme-free-bytes": str(usage.free), MEMLOCK_ANNOTATION: str(8 << 20)}
    cluster.kubectl("annotate", "node", node, "--overwrite", *[f"{k}={v}" for k, v in annotations.items()])
    storage_class = f"spillway-e2e-real-{secrets.token_hex(3)}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": storage_class},
        "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
    log = tmp_path_factory.mktemp("operator-real") / "operator.log"
    try:
        with running_operator(cluster, log, SPILLWAY_OPERATOR_RUNTIME_IMAGE=image,
                              SPILLWAY_OPERATOR_READ_MODEL_CONFIG="true", SPILLWAY_OPERATOR_KUEUE="true"):
            example = yaml.safe_load(EXAMPLE.read_text())["spec"]
            # The example is written for this cluster's real node and `spillway make-tiny`'s model.
            assert example["resources"]["nodeSelector"] == {label: "true"}
            assert example["model"]["parameterCount"] == str(shape_from_config(model).params)
            yield RealNode(cluster, root, label, storage_class, image)
    finally:
        cluster.kubectl("delete", "pv", "-l", "spillway.dev/e2e-real=true", "--wait=false", check=False)
        cluster.kubectl("delete", "storageclass", storage_class, check=False)
        cluster.kubectl("annotate", "node", node, *[f"{k}-" for k in annotations], check=False)
        shutil.rmtree(root, ignore_errors=True)


def _preferences_as_parquet(path: Path) -> None:
    """What examples/dpo-lora.yaml's comment says to put on the claim: the example's preference
    pairs whose prompt is text, as one Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (REPO_ROOT / "examples" / "data" / "arithmetic-preferences.jsonl").open()]
    pq.write_table(pa.Table.from_pylist([r for r in rows if isinstance(r["prompt"], str)]), path)


@pytest.fixture(scope="package")
def uninterrupted(real: RealNode, cluster: Cluster) -> Iterator[tuple[dict[str, Any], Path]]:
    """The reference: the tiny job run start to end in one pod (longer than the example, so
    that a suspend, a rollback and a lost pod fit in the interrupted run below)."""
    namespace = f"e2e-real-ref-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        real.inputs(namespace)
        checkpoints = real.job(namespace, "tiny", max_steps=MAX_STEPS)
        job = finished(real, namespace, "tiny")
        yield job, checkpoints
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
