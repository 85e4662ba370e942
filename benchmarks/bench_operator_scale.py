"""Operator scale benchmark: 300 FineTuneJobs across 100 kwok GPU nodes of mixed shapes.

Brings up its own control plane (hack/cluster, state under runs/bench/cluster), makes
100 kwok nodes (40 x 1 GPU 24 GB, 30 x 4 GPU 48 GB, 20 x 8 GPU 80 GB, 10 CPU-only),
starts the real operator, creates 300 jobs as fast as the client can, and watches the
pods: time from each job's create call to its pod's ADDED event (p50, p99), time until
every pod is bound to a node, the operator's resident memory, and its API requests per
job (from its own /metrics). Jobs are spread over the GPU shapes with nodeSelector so
that all 300 can be scheduled (40 + 120 + 160 GPUs, and memory: see MODELS). Target: p99
under 10 s.

The control plane, kwok and the operator share this machine's 2 cores, so the numbers
are an upper bound of what the operator itself costs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.operator_fixtures import CHECKPOINT_CLASS, CRD, OperatorProcess, job_manifest  # noqa: E402

STATE = ROOT / "runs" / "bench" / "cluster"
NAMESPACE = "scale"
SHAPES = [("gpu-24g", 40), ("gpu-48g-nvme", 30), ("gpu-80g", 20), ("cpu-only", 10)]
JOBS_PER_SHAPE = {"gpu-24g": 40, "gpu-48g-nvme": 100, "gpu-80g": 160}
# 7B jobs with the optimizer in CPU RAM request ~106 GiB each: two per 256 GiB L40S node.
# The L40S jobs fine-tune 1.3B models that fit their GPUs, so all 100 fit the 120 GPUs.
MODELS = {"gpu-24g": "7B", "gpu-48g-nvme": "1.3B", "gpu-80g": "7B"}


def sh(*args: str, env: dict[str, str], input: str | None = None) -> str:
    out = subprocess.run(args, env=env, input=input, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {out.stderr[-2000:]}")
    return out.stdout


def cluster_env() -> dict[str, str]:
    env = {**os.environ, "SPILLWAY_CLUSTER_DIR": str(STATE)}
    sh(str(ROOT / "hack" / "cluster"), "build", env=env)
    sh(str(ROOT / "hack" / "cluster"), "up", env=env)
    for line in sh(str(ROOT / "hack" / "cluster"), "env", env=env).splitlines():
        if line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = value.replace('"$PATH"', env.get("PATH", "")).strip("'\"")
    return env


def node_manifests() -> list[dict[str, object]]:
    import yaml

    nodes = []
    for profile, count in SHAPES:
        base = yaml.safe_load((ROOT / "hack" / "kwok" / "nodes" / f"{profile}.yaml").read_text())
        for i in range(count):
            node = json.loads(json.dumps(base))
            name = f"{profile}-{i:03d}"
            node["metadata"]["name"] = name
            node["metadata"]["labels"]["kubernetes.io/hostname"] = name
            nodes.append(node)
    return nodes


def checkpoint_volumes(count: int) -> list[dict[str, object]]:
    return [{
        "apiVersion": "v1", "kind": "PersistentVolume",
        "metadata": {"name": f"scale-ckpt-{i:03d}"},
        "spec": {"capacity": {"storage": "1Pi"}, "accessModes": ["ReadWriteOnce"],
                 "persistentVolumeReclaimPolicy": "Retain", "storageClassName": CHECKPOINT_CLASS,
                 "hostPath": {"path": f"/tmp/scale-ckpt-{i:03d}"}},
    } for i in range(count)]


def main() -> None:
    from kubernetes import client, config, watch

    env = cluster_env()
    try:
        kubectl = ("kubectl", "--kubeconfig", env["KUBECONFIG"])
        sh(*kubectl, "apply", "-f", str(CRD), env=env)
        sh(*kubectl, "apply", "-f", "-", env=env, input=json.dumps({
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": CHECKPOINT_CLASS},
            "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate"}))
        sh(*kubectl, "create", "namespace", NAMESPACE, env=env)
        sh(*kubectl, "create", "namespace", "spillway-system", env=env)
        items = [*node_manifests(), *checkpoint_volumes(300)]
        sh(*kubectl, "apply", "-f", "-", env=env, input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            # Ready, and the node lifecycle controller has lifted its not-ready taint: the
            # steady state of a cluster, not the minute after 100 machines joined it.
            nodes = json.loads(sh(*kubectl, "get", "nodes", "-o", "json", env=env))["items"]
            settled = [n for n in nodes if not (n["spec"].get("taints")) and any(
                c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))]
            if len(settled) >= 100:
                break
            time.sleep(1)

        config.load_kube_config(env["KUBECONFIG"])
        core, custom = client.CoreV1Api(), client.CustomObjectsApi()
        created_at: dict[str, float] = {}
        pod_added: dict[str, float] = {}
        pod_bound: dict[str, float] = {}
        stop = threading.Event()

        def watch_pods() -> None:
            while not stop.is_set():  # a loaded API server may cut a watch; start another
                w = watch.Watch()
                try:
                    for event in w.stream(core.list_namespaced_pod, NAMESPACE, timeout_seconds=60):
                        pod = event["object"]
                        job = (pod.metadata.labels or {}).get("spillway.dev/job")
                        now = time.monotonic()
                        if job:
                            pod_added.setdefault(job, now)
                            if pod.spec.node_name:
                                pod_bound.setdefault(job, now)
                        if stop.is_set():
                            w.stop()
                except Exception as err:
                    print(f"pod watch restarted: {err}", file=sys.stderr)

        job_scheduled: dict[str, float] = {}

        def watch_jobs() -> None:
            """When each job's status says Scheduled=True: the operator has seen the binding."""
            while not stop.is_set():
                w = watch.Watch()
                try:
                    for event in w.stream(custom.list_namespaced_custom_object, "spillway.dev", "v1alpha1",
                                          NAMESPACE, "finetunejobs", timeout_seconds=60):
                        job = event["object"]
                        conditions = (job.get("status") or {}).get("conditions") or []
                        if any(c["type"] == "Scheduled" and c["status"] == "True" for c in conditions):
                            job_scheduled.setdefault(job["metadata"]["name"], time.monotonic())
                        if stop.is_set():
                            w.stop()
                except Exception as err:
                    print(f"job watch restarted: {err}", file=sys.stderr)

        for target in (watch_pods, watch_jobs):
            threading.Thread(target=target, daemon=True).start()
        operator = OperatorProcess(env, STATE / "operator.log")
        # The operator's defaults, not the tests' quick-reacting settings; resync every 30 s.
        for key in ("BACKOFF_BASE_SECONDS", "REPLAN_PENDING_SECONDS", "PRICING_CACHE_SECONDS"):
            operator.env.pop(f"SPILLWAY_OPERATOR_{key}", None)
        operator.env["SPILLWAY_OPERATOR_RESYNC_SECONDS"] = "30"
        operator.start()
        time.sleep(5)  # operator start-up is not part of the per-job latency

        names = []
        for profile, count in JOBS_PER_SHAPE.items():
            for i in range(count):
                name = f"{profile}-job-{i:03d}"
                body = job_manifest(name, **{"model": {"uri": "file:///models/llama", "parameterCount": MODELS[profile]},
                                             "resources": {"gpusPerNode": 1,
                                                           "nodeSelector": {"spillway.dev/node-profile": profile}}})
                names.append(name)
                created_at[name] = time.monotonic()
                custom.create_namespaced_custom_object("spillway.dev", "v1alpha1", NAMESPACE, "finetunejobs", body)
        submit_seconds = time.monotonic() - min(created_at.values())
        first = min(created_at.values())
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and min(len(pod_bound), len(job_scheduled)) < len(names):
            time.sleep(0.5)
        stop.set()

        latencies = sorted(pod_added[n] - created_at[n] for n in names if n in pod_added)
        import psutil

        assert operator.proc is not None
        rss = psutil.Process(operator.proc.pid).memory_info().rss
        metrics = operator.metrics()
        by_call: dict[str, float] = {}
        for line in metrics.splitlines():
            if line.startswith("spillway_api_requests_total{"):
                call = line.split('call="', 1)[1].split('"', 1)[0]
                by_call[call] = by_call.get(call, 0.0) + float(line.split()[-1])
        requests = sum(by_call.values())
        operator.stop()
        unbound = [n for n in names if n not in pod_bound]
        why: dict[str, int] = {}
        for pod in core.list_namespaced_pod(NAMESPACE).items:
            job = (pod.metadata.labels or {}).get("spillway.dev/job")
            if job in unbound:
                for c in pod.status.conditions or []:
                    if c.type == "PodScheduled" and c.status == "False":
                        key = f"{c.reason}: {(c.message or '')[:200]}"
                        why[key] = why.get(key, 0) + 1

        print(f"jobs {len(names)}, nodes 100, submitted in {submit_seconds:.1f} s")
        print(f"pods created: {len(latencies)}/{len(names)}, bound to a node: {len(pod_bound)}/{len(names)}")
        if latencies:
            p50 = statistics.median(latencies)
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            print(f"create -> pod: p50 {p50:.2f} s, p99 {p99:.2f} s, max {latencies[-1]:.2f} s")
            print(f"RATIO p99 / 10 s target = {p99 / 10:.2f}")
        if len(pod_bound) == len(names):
            print(f"first create -> every job's pod bound: {max(pod_bound.values()) - first:.1f} s")
        if len(job_scheduled) == len(names):
            print(f"first create -> every job Scheduled (status condition): {max(job_scheduled.values()) - first:.1f} s")
        else:
            print(f"jobs with Scheduled=True: {len(job_scheduled)}/{len(names)}")
        print(f"operator RSS {rss / 2**20:.0f} MiB; Kubernetes API requests {requests:.0f} "
              f"({requests / len(names):.1f} per job)")
        for call, count in sorted(by_call.items(), key=lambda kv: -kv[1]):
            print(f"  {call:48s} {count:7.0f} ({count / len(names):.1f} per job)")
        for reason, count in sorted(why.items(), key=lambda kv: -kv[1]):
            print(f"  unbound x{count}: {reason}")
    finally:
        subprocess.run([str(ROOT / "hack" / "cluster"), "down"], env=env, check=False)


if __name__ == "__main__":
    main()
