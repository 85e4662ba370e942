"""Interrupted training jobs in real containers on the test cluster's real node, each
ending with the losses of an uninterrupted run, to the bit.

- The tiny job suspended (SIGTERM: the step finishes, a checkpoint, exit 75, phase
  Suspended), resumed (earlier checkpoints still listed in status), rolled back through
  the REST API (the old pod exits before the new one is created, and spares the named
  checkpoint from its pruning), its pod deleted mid-run and its training process
  SIGKILLed, ends Succeeded with every step's loss, every checkpoint's and the exported
  weights bit-equal to the uninterrupted run's.
- Two ranks in one pod, and two ranks on two real nodes (rank 1 finds rank 0 by its
  headless-Service name through the cluster's DNS): suspended and resumed, both end with
  the losses of an uninterrupted two-rank run, to the bit.
- Under a real Kueue, a job preempted by a higher-priority one checkpoints (exit 75, no
  failure counted), waits Queued while the other runs, and resumes with the uninterrupted
  run's losses, to the bit.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kubernetes.utils import parse_quantity

from tests.e2e.cluster import Cluster
from tests.e2e.local_volumes import LocalStorage
from tests.e2e.operator_fixtures import active_pods, wait_status
from tests.e2e.realnode.real_jobs import (
    MAX_STEPS,
    POD_TIMEOUT_S,
    RUNTIME_UID,
    TWO_RANK_STEPS,
    PodWatch,
    RealNode,
    condition,
    finished,
    kill_trainer,
    pod_events,
    why_failed,
)
from tests.e2e.test_api_cluster import ApiServer

pytestmark = [pytest.mark.e2e, pytest.mark.realnode]


def _weights(export: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(export / "model.safetensors"))


@pytest.fixture
def rest(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[tuple[ApiServer, str]]:
    """`spillway api --kubernetes` watching the cluster, and the token of an engineer who may
    change FineTuneJobs in the test's namespace (the REST rollback's caller)."""
    cluster.kubectl("create", "serviceaccount", "engineer", "-n", namespace)
    cluster.kubectl("create", "role", "ftj-edit", "--verb=get,list,watch,create,patch,delete",
                    "--resource=finetunejobs.spillway.dev", "-n", namespace)
    cluster.kubectl("create", "rolebinding", "engineer-ftj", "--role=ftj-edit",
                    f"--serviceaccount={namespace}:engineer", "-n", namespace)
    token = cluster.kubectl("create", "token", "engineer", "-n", namespace, "--duration=2h",
                            "--audience=spillway").stdout.strip()
    server = ApiServer(cluster.kubeconfig, tmp_path / "api.db", tmp_path / "api.log")
    server.start()
    try:
        yield server, token
    finally:
        server.stop()


def test_suspend_resume_rollback_and_a_deleted_pod_lose_no_step(
    real: RealNode, cluster: Cluster, kube_api: Any, namespace: str, uninterrupted: tuple[dict[str, Any], Path],
    rest: tuple[ApiServer, str],
) -> None:
    reference, reference_dir = uninterrupted
    api, token = rest
    jobs = f"/v1/namespaces/{namespace}/jobs"
    real.inputs(namespace)
    pods = PodWatch(kube_api, namespace, "tiny")
    checkpoints = real.job(namespace, "tiny", max_steps=MAX_STEPS)

    def step_at_least(n: int) -> Any:
        return lambda s: (s.get("progress") or {}).get("step", 0) >= n

    def one_pod() -> str:
        return str(cluster.wait_for(lambda: (a := active_pods(cluster, namespace, "tiny")) and len(a) == 1 and a[0],
                                    POD_TIMEOUT_S, what="one active pod"))

    def resumed_step(pod: str) -> int:
        return max((e["step"] for e in pod_events(cluster, namespace, pod) if e["event"] == "resumed"), default=1 << 30)

    def patch(spec: dict[str, Any]) -> None:
        cluster.kubectl("patch", "ftj", "tiny", "-n", namespace, "--type=merge", "-p", json.dumps({"spec": spec}))

    try:
        # Suspend: SIGTERM, the step finishes, a checkpoint of it, exit 75, phase Suspended.
        wait_status(cluster, namespace, "tiny", step_at_least(4), POD_TIMEOUT_S, "step 4")
        first = one_pod()
        patch({"suspend": True})
        suspended = wait_status(cluster, namespace, "tiny", lambda s: s.get("phase") == "Suspended" and not
                                active_pods(cluster, namespace, "tiny"), 300, "Suspended, no pod running")
        cluster.wait_for(lambda: pods.exit_code(first) is not None, 300, what=f"{first}'s exit")
        assert pods.exit_code(first) == 75
        suspended = cluster.get("finetunejob", "tiny", namespace) or suspended  # with the stop checkpoint
        stopped = max(c["step"] for c in suspended["status"]["checkpoints"])
        assert stopped >= 4 and (checkpoints / f"step-{stopped:08d}").is_dir()

        # Resume: from that checkpoint; the new pod lists the first pod's checkpoints too.
        patch({"suspend": False})
        resumed = wait_status(cluster, namespace, "tiny", step_at_least(stopped + 3), POD_TIMEOUT_S,
                              "resumed, 3 steps on")
        assert stopped in [c["step"] for c in resumed["status"]["checkpoints"]]
        second = one_pod()
        assert second != first
        assert resumed_step(second) == stopped  # the suspend's own checkpoint, not an older one

        # Roll back to the newest checkpoint listed (an older one may be pruned by the time the
        # running pod stops: see the closing note of issue 12): the running pod checkpoints and
        # exits before the next one is even created (both would write to the same volume).
        # Through the REST API, as a user would: it sets spec.resumeFrom.
        target = max(resumed["status"]["checkpoints"], key=lambda c: c["step"])
        cluster.wait_for(lambda: target["name"] in [c["name"] for c in
                                                    api.call("GET", f"{jobs}/tiny/checkpoints", token).json()["data"]],
                         60, what="the API to record the checkpoint")
        r = api.call("POST", f"{jobs}/tiny/rollback", token, {"checkpoint": target["name"], "reason": "e2e"})
        assert r.status_code == 202, r.text
        assert r.json()["toStep"] == target["step"]
        third = cluster.wait_for(lambda: (a := active_pods(cluster, namespace, "tiny")) and a[0] != second and a[0],
                                 POD_TIMEOUT_S, what="the rolled-back attempt's pod")
        # The watch runs in its own thread and may lag the API reads above: wait until it
        # has seen the new pod; what came before it in the API server's order is then in.
        cluster.wait_for(lambda: third in pods.names(), 60, what=f"the watch to see {third}")
        assert pods.exit_code(second) == 75, pods.events
        assert pods.exited(second) < pods.index("ADDED", third), pods.events
        rolled = cluster.wait_for(
            lambda: [e for e in pod_events(cluster, namespace, third) if e["event"] == "rolled_back"],
            POD_TIMEOUT_S, interval=2, what="the new pod's rollback")
        assert rolled[0]["checkpoint"] == target["name"] and rolled[0]["step"] == target["step"]
        done = cluster.wait_for(lambda: [x for x in api.call("GET", f"{jobs}/tiny/history", token).json()["rollbacks"]
                                         if x["completedAt"]], 60, what="the API to record the rollback as done")
        assert [(x["checkpoint"], x["origin"], x["requestedBy"]) for x in done] == [
            (target["name"], "api", f"system:serviceaccount:{namespace}:engineer")]

        # A lost pod: the next attempt resumes from the last checkpoint.
        cluster.wait_for(lambda: any(e["event"] == "checkpoint" and e["step"] > target["step"]
                                     for e in pod_events(cluster, namespace, third)),
                         POD_TIMEOUT_S, interval=1, what="a checkpoint after the rollback")
        cluster.kubectl("delete", "pod", third, "-n", namespace, "--wait=false")

        # The training process SIGKILLed inside its container (as the OOM killer would): no
        # stop checkpoint, exit 137; the next attempt resumes from the last cadence checkpoint.
        fourth = cluster.wait_for(lambda: (a := active_pods(cluster, namespace, "tiny")) and a[0] not in (first, second, third)
                                  and a[0], POD_TIMEOUT_S, what="the attempt after the deleted pod")
        cluster.wait_for(lambda: any(e["event"] == "checkpoint" and e["step"] > resumed_step(fourth)
                                     for e in pod_events(cluster, namespace, fourth)),
                         POD_TIMEOUT_S, interval=1, what=f"a checkpoint of {fourth}")
        assert kill_trainer(namespace, "tiny") >= 1
        job = finished(real, namespace, "tiny")
    finally:
        pods.stop()
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    assert len(pods.names()) == 5, pods.names()  # five attempts
    assert pods.exit_code(fourth) == 137, pods.events

    # No step lost or replayed differently: every step the last pod logged has the
    # uninterrupted run's loss, to the bit, and so has every kept checkpoint; the exported
    # weights are the same bytes.
    [last] = [name for name in pods.names() if name not in (first, second, third, fourth)]
    logged = [(e["step"], e["loss"]) for e in pod_events(cluster, namespace, last) if e["event"] == "step"]
    resumed_from = [e for e in pod_events(cluster, namespace, last) if e["event"] == "resumed"]
    assert resumed_from and resumed_from[0]["step"] > resumed_step(fourth), resumed_from  # the last before the kill
    reference_steps = {e["step"]: e["loss"] for e in pod_events(cluster, reference["metadata"]["namespace"], "tiny-a0-0")
                       if e["event"] == "step"}
    assert sorted(reference_steps) == list(range(1, MAX_STEPS + 1))
    assert [step for step, _ in logged] == list(range(resumed_from[0]["step"] + 1, MAX_STEPS + 1)), logged
    mismatches = {step: (loss, reference_steps[step]) for step, loss in logged if loss != reference_steps[step]}
    assert not mismatches, f"losses differ from the uninterrupted run's at steps {mismatches}"
    expected = {c["step"]: c["loss"] for c in reference["status"]["checkpoints"]}
    got = {c["step"]: c["loss"] for c in status["checkpoints"]}
    # As many kept as the reference's, the last at the end; a stop checkpoint off the cadence
    # may be among them, depending on when the pod was deleted
    assert len(got) == len(expected) and max(got) == MAX_STEPS, sorted(got)
    assert {step: (loss, reference_steps[step]) for step, loss in got.items() if loss != reference_steps[step]} == {}
    assert {s: got[s] for s in got if s in expected} == {s: expected[s] for s in expected if s in got}
    mine, theirs = _weights(checkpoints / "export"), _weights(reference_dir / "export")
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key].view(torch.uint8), theirs[key].view(torch.uint8)), key


@pytest.mark.pod_security("restricted")
def test_a_two_rank_pod_suspends_with_75_and_resumes_to_the_same_losses(
    real: RealNode, cluster: Cluster, kube_api: Any, namespace: str, local_storage: LocalStorage
) -> None:
    """Two ranks in one pod under our supervisor (resources.cpuProcesses): a suspend reaches
    both, they checkpoint together and the pod exits 75; the resumed pod's losses equal an
    uninterrupted two-rank run's, to the bit.

    Their NVMe is what a cluster admin offers without host paths: a generic ephemeral volume
    of a local-volume provisioner's StorageClass (tests/e2e/local_volumes.py), one per pod,
    in a namespace that enforces Pod Security `restricted`. The kubelet gives the volume to
    the pod's fsGroup (the provisioner makes it root's, 0700): the ranks' swap files are
    written there, and the volume is gone with its pod."""
    real.inputs(namespace)
    pods = PodWatch(kube_api, namespace, "two")
    on_local_volume = {"offload": {"nvme": {"storageClassName": local_storage.storage_class}}}
    real.job(namespace, "two-ref", max_steps=TWO_RANK_STEPS, processes=2, spec_update=on_local_volume)
    real.job(namespace, "two", max_steps=TWO_RANK_STEPS, processes=2, spec_update=on_local_volume)
    try:
        [first], stopped, job = _suspend_then_resume(real, pods, namespace, "two", _swaps_on_local_volume(
            real, namespace, local_storage))
        reference = finished(real, namespace, "two-ref")
    finally:
        pods.stop()
    assert job["status"]["phase"] == reference["status"]["phase"] == "Succeeded", why_failed(job, reference)
    [last] = [name for name in pods.names() if name != first]
    log = pod_events(cluster, namespace, last)
    _assert_resumed_as_reference(cluster, namespace, log, "two-ref-a0-0", stopped)
    started = [e for e in [*log, *pod_events(cluster, namespace, "two-ref-a0-0")] if e["event"] == "started"]
    assert [e["world_size"] for e in started] == [2, 2], started


def _swaps_on_local_volume(real: RealNode, namespace: str, storage: LocalStorage) -> Callable[[list[str]], None]:
    """While the pod runs: its NVMe volume is a provisioned `local` volume of the class, its
    directory on the node holds both ranks' swap files, and nothing else of the node is
    mounted for it."""
    def check(pods: list[str]) -> None:
        [pod] = pods
        spec = real.cluster.kubectl_json("get", "pod", pod, "-n", namespace)["spec"]
        assert not [v for v in spec["volumes"] if "hostPath" in v], spec["volumes"]
        claim = real.cluster.kubectl_json("get", "pvc", f"{pod}-nvme", "-n", namespace)
        assert claim["spec"]["storageClassName"] == storage.storage_class
        volume = real.cluster.kubectl_json("get", "pv", claim["spec"]["volumeName"])
        directory = Path(volume["spec"]["local"]["path"])
        assert directory.parent == storage.root
        assert directory.stat().st_gid == RUNTIME_UID  # the pod's fsGroup, given by the kubelet
        real.cluster.wait_for(lambda: len({p.parent for p in directory.rglob("*.swp")}) >= 2, 120,
                              what=f"both ranks' swap files under {directory}")
    return check


def _suspend_then_resume(real: RealNode, pods: PodWatch, namespace: str, name: str,
                         while_running: Callable[[list[str]], None] = lambda _: None) -> tuple[list[str], int, dict[str, Any]]:
    """From step 3, suspend the job (every pod of the attempt must exit 75), resume it and
    follow it to its end. Returns the suspended attempt's pods, the stop checkpoint's step
    and the finished job; ``while_running`` sees the pods before the suspend."""
    cluster = real.cluster
    wait_status(cluster, namespace, name, lambda s: (s.get("progress") or {}).get("step", 0) >= 3,
                POD_TIMEOUT_S, "step 3")
    first = sorted(active_pods(cluster, namespace, name))
    while_running(first)
    cluster.kubectl("patch", "ftj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    wait_status(cluster, namespace, name, lambda s: s.get("phase") == "Suspended" and not
                active_pods(cluster, namespace, name), 300, "Suspended, no pod running")
    cluster.wait_for(lambda: all(pods.exit_code(p) is not None for p in first), 300, what=f"{first} to exit")
    assert [pods.exit_code(p) for p in first] == [75] * len(first), pods.events
    # The phase says Suspended from the SIGTERM on; the stop checkpoint is in status
    # once the pods have exited (the runtime publishes it before it exits).
    suspended = cluster.get("finetunejob", name, namespace)
    assert suspended is not None
    stopped = max(c["step"] for c in suspended["status"]["checkpoints"])
    cluster.kubectl("patch", "ftj", name, "-n", namespace, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    return first, stopped, finished(real, namespace, name)


def _assert_resumed_as_reference(cluster: Cluster, namespace: str, log: list[dict[str, Any]], reference_pod: str,
                                 stopped: int) -> None:
    """The resumed run started from the stop checkpoint, and every later step's loss equals
    the uninterrupted reference run's, to the bit."""
    # On failure, what the resumed run said instead (a checkpoint it rejected, and why).
    said = json.dumps([e for e in log if e["event"] != "step"])[:6000]
    assert [e["step"] for e in log if e["event"] == "resumed"] == [stopped], said
    expected = {e["step"]: e["loss"] for e in pod_events(cluster, namespace, reference_pod) if e["event"] == "step"}
    got = {e["step"]: e["loss"] for e in log if e["event"] == "step"}
    assert sorted(got) == list(range(stopped + 1, TWO_RANK_STEPS + 1))
    assert {s: (got[s], expected[s]) for s in got if got[s] != expected[s]} == {}


@pytest.fixture
def second_node(real: RealNode, cluster: Cluster) -> Iterator[str]:
    """Real node 2 made like node 1 for a test that means to use it: the training image in
    its containerd, node 1's NVMe figures (the planner groups the two as one shape). The
    image is removed afterwards: a second unpacked copy costs gigabytes of disk."""
    settings = cluster.settings()
    node = settings["NODE2_NAME"]
    image = cluster.load_images("runtime-cpu", node=2)["runtime-cpu"]
    assert image == real.image
    ours = {k: v for k, v in cluster.kubectl_json("get", "node", cluster.real_node)["metadata"]["annotations"].items()
            if k.startswith("spillway.dev/")}
    cluster.kubectl("annotate", "node", node, "--overwrite", *[f"{k}={v}" for k, v in ours.items()])
    try:
        yield node
    finally:
        cluster.kubectl("annotate", "node", node, *[f"{k}-" for k in ours], check=False)
        subprocess.run(["ctr", "--address", settings["CONTAINERD2_SOCKET"], "-n", "k8s.io", "images", "rm",
                        "--sync", image], capture_output=True, timeout=300)


def test_a_two_node_job_meets_across_real_nodes_and_resumes_to_the_same_losses(
    real: RealNode, second_node: str, cluster: Cluster, kube_api: Any, namespace: str
) -> None:
    """resources.nodes 2 on two real nodes: one pod on each; rank 1 finds rank 0 by its
    headless-Service name (CoreDNS) and their gloo traffic crosses from one node's bridge to
    the other's. A suspend reaches both pods, both checkpoint and exit 75; the resumed pair
    ends with the losses of an uninterrupted two-rank run in one pod, to the bit."""
    real.inputs(namespace)
    pods = PodWatch(kube_api, namespace, "nodes")
    real.job(namespace, "nodes-ref", max_steps=TWO_RANK_STEPS, processes=2)
    real.job(namespace, "nodes", max_steps=TWO_RANK_STEPS, nodes=2)

    def one_pod_on_each_node(first: list[str]) -> None:
        placed = {p: cluster.get("pod", p, namespace)["spec"]["nodeName"] for p in first}
        assert sorted(placed.values()) == sorted([cluster.real_node, second_node]), placed

    try:
        first, stopped, job = _suspend_then_resume(real, pods, namespace, "nodes", one_pod_on_each_node)
        assert len(first) == 2
        reference = finished(real, namespace, "nodes-ref")
    finally:
        pods.stop()
    assert job["status"]["phase"] == reference["status"]["phase"] == "Succeeded", why_failed(job, reference)
    [rank0] = [name for name in pods.names() if name not in first and name.endswith("-0")]
    log = pod_events(cluster, namespace, rank0)
    _assert_resumed_as_reference(cluster, namespace, log, "nodes-ref-a0-0", stopped)
    started = [e for e in log if e["event"] == "started"]
    assert [e["world_size"] for e in started] == [2], started


def test_a_job_preempted_by_kueue_checkpoints_and_resumes_with_no_lost_step(
    real: RealNode, cluster: Cluster, kube_api: Any, namespace: str, uninterrupted: tuple[dict[str, Any], Path],
    kueue: Any,
) -> None:
    """Under a real Kueue: a ClusterQueue with room for one tiny job on the real node and
    preemption of lower priorities. A higher-priority job arrives while the first trains;
    Kueue evicts the first, whose pod checkpoints and exits 75 (no failure counted), the
    quota goes to the second, which runs to the end; the first is admitted again and
    resumes from its stop checkpoint, every later step's loss equal to an uninterrupted
    run's, to the bit."""
    reference, _ = uninterrupted
    real.inputs(namespace)
    suffix = secrets.token_hex(3)
    low, high = kueue.priority_class(f"low-{suffix}", 10), kueue.priority_class(f"high-{suffix}", 1000)
    flavor = kueue.flavor(f"real-{suffix}", node_labels={real.label: "true"})
    cq_name = f"real-{suffix}"
    kueue.local_queue(namespace, "team", cq_name)  # its ClusterQueue follows, sized to the job
    pods = PodWatch(kube_api, namespace, "tiny")
    queued = {"queueName": "team"}
    # A checkpoint at every step (the losses do not change: exact resume) keeps the run going
    # while Kueue's preemption reaches its pod: once the runtime started faster, 40 bare steps
    # ended first in one gate (exit 0, not 75).
    real.job(namespace, "tiny", max_steps=MAX_STEPS, labels={"kueue.x-k8s.io/priority-class": low}, top=queued,
             spec_update={"checkpoint": {"everySteps": 1}})
    [wl] = cluster.wait_for(lambda: cluster.kubectl_json("get", "workloads.kueue.x-k8s.io", "-n", namespace,
                                                         "-l", "spillway.dev/job=tiny")["items"], 120,
                            what="the job's Workload")
    requests = wl["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"]["requests"]
    # Room for one such job, not two.
    kueue.cluster_queue(cq_name, {flavor: {k: str(int(parse_quantity(v) * 3 // 2)) for k, v in requests.items()}},
                        preemption={"withinClusterQueue": "LowerPriority"})
    try:
        wait_status(cluster, namespace, "tiny", lambda s: (s.get("progress") or {}).get("step", 0) >= 1,
                    POD_TIMEOUT_S, "the first step")
        [first] = active_pods(cluster, namespace, "tiny")
        real.job(namespace, "urgent", max_steps=6, labels={"kueue.x-k8s.io/priority-class": high}, top=queued)
        evicted = wait_status(cluster, namespace, "tiny", lambda s: s.get("phase") == "Queued"
                              and not active_pods(cluster, namespace, "tiny"), 300, "tiny evicted, no pod running")
        assert condition(evicted, "Admitted")["reason"] == "Evicted"
        assert "Preempted" in condition(evicted, "Admitted")["message"]
        cluster.wait_for(lambda: pods.exit_code(first) is not None, 300, what=f"{first}'s exit")
        assert pods.exit_code(first) == 75
        stopped = max(c["step"] for c in (cluster.get("finetunejob", "tiny", namespace) or {})["status"]["checkpoints"])
        urgent = finished(real, namespace, "urgent")
        assert urgent["status"]["phase"] == "Succeeded"
        job = finished(real, namespace, "tiny")
    finally:
        pods.stop()
    status = job["status"]
    assert status["phase"] == "Succeeded", json.dumps(status)[-2000:]
    assert status.get("failures", 0) == 0
    [last] = [name for name in pods.names() if name != first]
    log = pod_events(cluster, namespace, last)
    assert [e["step"] for e in log if e["event"] == "resumed"] == [stopped]
    expected = {e["step"]: e["loss"] for e in pod_events(cluster, reference["metadata"]["namespace"], "tiny-a0-0")
                if e["event"] == "step"}
    got = {e["step"]: e["loss"] for e in log if e["event"] == "step"}
    assert sorted(got) == list(range(stopped + 1, MAX_STEPS + 1))
    assert {s: (got[s], expected[s]) for s in got if got[s] != expected[s]} == {}
