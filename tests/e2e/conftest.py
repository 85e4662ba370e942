"""Fixtures for end-to-end tests against a real Kubernetes control plane.

Where this sits: tests/e2e only. ``hack/cluster`` builds (once, into a cache
outside the repository) and runs etcd, kube-apiserver,
kube-controller-manager, kube-scheduler and kwok on 127.0.0.1; see
hack/CLUSTER.md. The ``cluster`` fixture starts one such control plane per
pytest session and stops it afterwards, or uses an existing one when
``SPILLWAY_E2E_USE_EXISTING=1`` and ``KUBECONFIG`` point at it. Nothing here
mocks Kubernetes: tests talk to the API server through ``kubectl``, ``helm``
or the ``kubernetes`` Python client.

Fixtures:
    cluster        session  Cluster (tests/e2e/cluster.py): kubeconfig, env,
                            kubectl/helm runners, node and pod helpers, wait_for.
    kubeconfig     session  str: path of an admin kubeconfig.
    kube_api       session  kubernetes.client.ApiClient for that kubeconfig.
    namespace      function str: a fresh namespace, deleted after the test, with
                            the Pod Security level the test asks for
                            (@pytest.mark.pod_security("privileged"); restricted
                            by default) and a bound read-only claim `inputs`
                            that job_manifest's pvc:// URIs name.
    host_dir       function Path: a directory under /tmp a container's uid can
                            reach, for hostPath volumes on the real node.
    make_node      function make_node(profile, name=None, nvme_volume=False)
                            -> node name; a kwok node from
                            hack/kwok/nodes/<profile>.yaml, Ready, optionally
                            with a local NVMe PersistentVolume; deleted after
                            the test.
    set_pod_phase  function set_pod_phase(namespace, pod, phase, exit_code=None)
                            -> pod dict; ends a Running pod on a kwok node.
    delete_node    function delete_node(name): simulate losing a node.

If the control plane cannot be built or started, the session fails with the
reason; e2e tests are never skipped for want of a cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import (
    HACK_CLUSTER,
    KWOK_NODE_LABEL,
    Cluster,
)
from tests.e2e.operator_fixtures import INPUTS_CLAIM

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"

# A cold build compiles Kubernetes from source: ~10-15 minutes on 2 cores
# (measured 10 min); the limit leaves room for a slow or busy machine.
BUILD_TIMEOUT_S = 90 * 60
UP_TIMEOUT_S = 180
# The namespace label the API server's Pod Security admission enforces, and its levels.
POD_SECURITY_LABEL = "pod-security.kubernetes.io/enforce"
POD_SECURITY_LEVELS = ("restricted", "baseline", "privileged")

_BUILD_FAILURE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "e2e: needs a real Kubernetes control plane (hack/cluster); "
        "slow the first time, when it builds the binaries",
    )
    config.addinivalue_line(
        "markers",
        "pod_security(level): the Pod Security level (restricted, baseline, privileged) that the "
        "`namespace` fixture enforces on the test's namespace; restricted when not given. A test "
        "whose pods mount a hostPath (NVMe on the node's root, the node's S3 cache, the chart's "
        "node probe) asks for privileged",
    )


# What `Cluster.get` reads over HTTP: the kinds tests poll, by every name they use.


def _hack_cluster(
    command: str, state_dir: Path | None, timeout: float, log_file: Path | None = None,
    images_dir: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if state_dir is not None:
        env["SPILLWAY_CLUSTER_DIR"] = str(state_dir)
    # Only the cluster given it keeps its images there (one cluster at a time on those roots)
    env.pop("SPILLWAY_CLUSTER_IMAGES_DIR", None)
    if images_dir is not None:
        env["SPILLWAY_CLUSTER_IMAGES_DIR"] = str(images_dir)
    try:
        if log_file is None:
            return subprocess.run(
                [str(HACK_CLUSTER), command],
                capture_output=True,
                text=True,
                env=env,
                timeout=timeout,
                check=False,
            )
        with log_file.open("w") as out:
            proc = subprocess.run(
                [str(HACK_CLUSTER), command],
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                timeout=timeout,
                check=False,
            )
        return subprocess.CompletedProcess(proc.args, proc.returncode, log_file.read_text(), "")
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        output = log_file.read_text() if log_file else (partial or "")
        return subprocess.CompletedProcess(exc.cmd, -1, f"{output}\n(timed out after {timeout}s)", "")


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _parse_env(script: str) -> dict[str, str]:
    """Read `hack/cluster env` output: export KUBECONFIG=...; export PATH=a:b:"$PATH"."""
    env = dict(os.environ)
    for line in script.splitlines():
        m = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if not m:
            continue
        key, value = m.groups()
        value = value.replace('"$PATH"', env.get("PATH", ""))
        env[key] = value.strip("'")
    return env


def _needs_cluster(items: list[pytest.Item]) -> bool:
    return any(item.get_closest_marker("e2e") for item in items)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before the first e2e test starts, outside any
    per-test timeout: a cold build compiles Kubernetes (~10-15 min on 2
    cores), a warm one returns at once. Its start and end are announced on
    the terminal, so that a first run does not look hung. A failure is recorded and
    reported by the ``cluster`` fixture, so every e2e test fails with it."""
    if not _needs_cluster(session.items) or session.config.option.collectonly:
        return
    probe = _hack_cluster("status", None, timeout=60)
    if "missing" not in probe.stdout:
        return
    cache = Path(os.environ.get("SPILLWAY_CACHE") or Path.home() / ".cache" / "spillway")
    log_file = cache / "k8s-bin" / "build.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    capture = session.config.pluginmanager.getplugin("capturemanager")
    ctx = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    with ctx:
        print(f"\n[e2e] building the control plane (hack/cluster build); log: {log_file}", flush=True)
        started = time.monotonic()
        proc = _hack_cluster("build", None, timeout=BUILD_TIMEOUT_S, log_file=log_file)
        took = time.monotonic() - started
        print(f"[e2e] hack/cluster build: exit {proc.returncode} after {took:.0f}s", flush=True)
    if proc.returncode != 0:
        session.config.stash[_BUILD_FAILURE] = (
            f"hack/cluster build failed (exit {proc.returncode}); the e2e tests need it. "
            f"Log: {log_file}\n{_tail(proc.stdout)}"
        )


def _env_with_tools(kubeconfig: Path) -> dict[str, str]:
    proc = _hack_cluster("env", None, timeout=30)
    if proc.returncode != 0:
        pytest.fail(f"hack/cluster env failed:\n{proc.stdout}{proc.stderr}", pytrace=False)
    env = _parse_env(proc.stdout)
    env["KUBECONFIG"] = str(kubeconfig)
    return env


def _start_cluster(state_dir: Path, images_dir: Path | None) -> None:
    # With a real NetworkPolicy enforcer (kube-router's firewall, for real node 1's pods):
    # the policies the chart and the operator make are enforced, not only stored.
    os.environ.setdefault("SPILLWAY_CLUSTER_NETWORK_POLICY", "1")
    proc = _hack_cluster("up", state_dir, timeout=UP_TIMEOUT_S, images_dir=images_dir)
    if proc.returncode != 0:
        _hack_cluster("down", state_dir, timeout=60)
        pytest.fail(
            f"hack/cluster up failed (exit {proc.returncode}); logs in {state_dir / 'logs'}\n"
            f"{_tail(proc.stdout + proc.stderr)}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def cluster_images_dir() -> Path | None:
    """Where the cluster's real nodes keep the images imported into them: None, in the
    session's own state dir (tests/e2e/realnode overrides it)."""
    return None


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            cluster_images_dir: Path | None) -> Iterator[Cluster]:
    """A control plane for the whole session (see module docstring)."""
    failure = request.config.stash.get(_BUILD_FAILURE, None)
    if failure:
        pytest.fail(failure, pytrace=False)
    # Normally a no-op: pytest_collection_finish built what was missing.
    build = _hack_cluster("build", None, timeout=BUILD_TIMEOUT_S)
    if build.returncode != 0:
        pytest.fail(f"hack/cluster build failed:\n{_tail(build.stdout + build.stderr)}", pytrace=False)
    work = tmp_path_factory.mktemp("e2e")

    if os.environ.get("SPILLWAY_E2E_USE_EXISTING") == "1":
        if not os.environ.get("KUBECONFIG"):
            pytest.fail(
                "SPILLWAY_E2E_USE_EXISTING=1 needs KUBECONFIG set to the cluster's kubeconfig", pytrace=False
            )
        kubeconfig = Path(os.environ["KUBECONFIG"])
        state_dir: Path | None = None
    else:
        # A state dir of our own: a cluster someone started by hand with
        # `hack/cluster up` is neither reused nor stopped by the tests.
        state_dir = work / "cluster"
        # Backstop for a session that dies without running fixture teardown;
        # `down` is a no-op once the teardown below has run it.
        atexit.register(_hack_cluster, "down", state_dir, 120)
        _start_cluster(state_dir, cluster_images_dir)
        kubeconfig = state_dir / "kubeconfig"

    env = _env_with_tools(kubeconfig)
    # helm keeps repositories and caches under these; keep them out of $HOME.
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(work / "helm" / var.split("_")[1].lower())
    c = Cluster(kubeconfig=kubeconfig, env=env, state_dir=state_dir, started_here=state_dir is not None)

    ready = c.kubectl("get", "--raw", "/readyz", check=False)
    if ready.returncode != 0:
        if state_dir is not None:
            _hack_cluster("down", state_dir, timeout=60)
        pytest.fail(f"the API server at {kubeconfig} is not ready:\n{ready.stderr}", pytrace=False)

    # Code under test that reads KUBECONFIG/PATH itself (the kubernetes client,
    # an operator subprocess) finds this cluster and its tools too.
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    os.environ["KUBECONFIG"] = str(kubeconfig)
    os.environ["PATH"] = env["PATH"]
    # The kubernetes client reads KUBECONFIG once, when first imported; a test that ran
    # before this fixture (the unit tests, with `pytest tests/unit tests/e2e`) imported it.
    from kubernetes.config import kube_config

    saved_default = kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(kubeconfig)
    try:
        yield c
    finally:
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = saved_default
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if state_dir is not None:
            down = _hack_cluster("down", state_dir, timeout=120)
            if down.returncode != 0:
                print(f"hack/cluster down failed:\n{down.stdout}{down.stderr}")


@pytest.fixture(scope="session")
def kubeconfig(cluster: Cluster) -> str:
    return str(cluster.kubeconfig)


@pytest.fixture(scope="session")
def kube_api(cluster: Cluster) -> Iterator[Any]:
    """A ``kubernetes.client.ApiClient`` logged in as the cluster admin."""
    from kubernetes import config as k8s_config

    api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))  # type: ignore[no-untyped-call]
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def host_dir() -> Iterator[Path]:
    """A directory on this machine, which is also the real node, that a container's
    uid can reach (pytest's own tmp dirs are root's, 0700): hostPath volumes' home."""
    path = Path("/tmp") / f"spillway-e2e-{secrets.token_hex(4)}"
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _namespace_name(nodeid: str) -> str:
    test = re.sub(r"[^a-z0-9]+", "-", nodeid.rsplit("::", 1)[-1].lower()).strip("-")
    return f"e2e-{test[:40].rstrip('-')}-{secrets.token_hex(3)}"


def _pod_security_level(item: pytest.Item) -> str | None:
    """The level a test's namespace enforces: its `pod_security` marker's, else restricted.
    None for a real-node test (its own tier), whose namespace stays as it was written for."""
    marker = item.get_closest_marker("pod_security")
    if marker is None:
        return None if item.get_closest_marker("realnode") else "restricted"
    [level] = marker.args
    if level not in POD_SECURITY_LEVELS:
        raise ValueError(f"pod_security({level!r}): the levels are {', '.join(POD_SECURITY_LEVELS)}")
    return str(level)


def _inputs_claim(namespace: str) -> dict[str, Any]:
    """The claim `inputs` of ``namespace``, naming its volume (_inputs_volume)."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": INPUTS_CLAIM, "namespace": namespace},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": _inputs_volume_name(namespace),
                     "resources": {"requests": {"storage": "1Ti"}}}}


def _inputs_volume_name(namespace: str) -> str:
    return f"{namespace}-{INPUTS_CLAIM}"


def _inputs_volume(namespace: str, claim_uid: str) -> dict[str, Any]:
    """The claim's PersistentVolume, bound to it by uid. Nothing is read from it: kwok runs
    no container."""
    name = _inputs_volume_name(namespace)
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "1Ti"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                     "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": f"/tmp/{name}"},
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": namespace,
                                  "name": INPUTS_CLAIM, "uid": claim_uid}}}


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace, with its default service account, deleted afterwards. It enforces
    the test's Pod Security level (see _pod_security_level) and, but for a real-node test,
    holds the claim `inputs` (INPUTS_CLAIM), bound, that job_manifest's pvc:// URIs name: a
    cluster job reads its inputs from a claim of its namespace, never from the pod's own
    filesystem.

    The claim is bound by hand, as kube-scheduler places no pod whose claim is unbound:
    kube-controller-manager's own binding of a claim to the volume it names races the
    controller's volume worker, and the loser's conflict waits for the resync, 15 s later
    (one claim in three here). So the volume names the claim by uid (the controller then
    marks it Bound alone), and once it is Bound, the claim gets the annotation that the
    controller would write, after which the controller only sets the claim's phase."""
    name = _namespace_name(request.node.nodeid)
    labels = {"spillway.dev/e2e": "true"}
    level = _pod_security_level(request.node)
    if level:
        labels[POD_SECURITY_LABEL] = level
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}]
    real_node = request.node.get_closest_marker("realnode") is not None
    if not real_node:
        objects.append(_inputs_claim(name))
    # Few requests: a namespace is made for every test, and each kubectl costs ~0.15 s.
    made = cluster.kubectl("create", "-f", "-", "-o", "jsonpath={.kind}={.metadata.uid}{'\\n'}",
                           input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    uids = dict(line.split("=", 1) for line in made.stdout.split())
    # Pods are rejected until the serviceaccount controller has made `default`.
    waited = {"ServiceAccount": ""}
    try:
        if not real_node:
            cluster.kubectl("create", "-f", "-", input=json.dumps(_inputs_volume(name, uids["PersistentVolumeClaim"])))
            waited["PersistentVolume"] = "Bound"

        def phases() -> bool:
            got = cluster.kubectl("get", "-n", name, "serviceaccount/default", f"pv/{_inputs_volume_name(name)}",
                                  "--ignore-not-found", "-o", "json").stdout
            found = json.loads(got) if got.strip() else {"items": []}
            items = found["items"] if found.get("kind") == "List" else [found]
            return {item["kind"]: item.get("status", {}).get("phase", "") for item in items} == waited

        cluster.wait_for(phases, timeout=30, interval=0.1, what=f"{name}'s service account and {waited}")
        if not real_node:
            cluster.kubectl("annotate", "pvc", INPUTS_CLAIM, "-n", name, "pv.kubernetes.io/bind-completed=yes")
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
        if not real_node:
            cluster.kubectl("delete", "pv", _inputs_volume_name(name), "--wait=false", "--ignore-not-found",
                            check=False)


@pytest.fixture
def make_node(cluster: Cluster) -> Iterator[Callable[..., str]]:
    """make_node(profile, name=None, nvme_volume=False) -> name; the nodes,
    and local volumes made for them, are deleted after the test."""
    created: list[str] = []

    def _make(profile: str, name: str | None = None, nvme_volume: bool = False) -> str:
        node = cluster.make_node(profile, name, nvme_volume=nvme_volume)
        created.append(node)
        return node

    try:
        yield _make
    finally:
        for node in created:
            cluster.delete_node(node)
            cluster.kubectl(
                "delete", "pv", "-l", f"{KWOK_NODE_LABEL}={node}", "--wait=false", "--ignore-not-found"
            )


@pytest.fixture
def set_pod_phase(cluster: Cluster) -> Callable[..., dict[str, Any]]:
    """set_pod_phase(namespace, pod, "Succeeded"|"Failed", exit_code=None) -> pod."""
    return cluster.set_pod_phase


@pytest.fixture
def delete_node(cluster: Cluster) -> Callable[[str], None]:
    """delete_node(name): the node disappears, as when a machine is lost."""
    return cluster.delete_node


@pytest.fixture(scope="session")
def kueue_manager(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Kueue manager for the session (tests/e2e/kueue_fixtures.py), started by the first test
    that asks for it (~25 s) and kept for the others."""
    from tests.e2e.kueue_fixtures import running_kueue

    with running_kueue(cluster, tmp_path_factory.mktemp("kueue")) as k:
        yield k


@pytest.fixture
def kueue(kueue_manager: Any, cluster: Cluster, namespace: str) -> Iterator[Any]:
    """The session's Kueue; what a test made with it (flavours, queues, priority classes) is
    deleted after the test, so that no later test's operator plans on its flavours (an
    annotated flavour is a node pool). `.log` is the manager's log.

    The test's jobs and Workloads go first: Kueue's finalizer holds a ClusterQueue until its
    admitted Workloads are gone, and the namespace that holds them is deleted only after this
    (each of three tests waited out the whole 30 s for its queue)."""
    try:
        yield kueue_manager
    finally:
        cluster.kubectl("delete", "finetunejobs.spillway.dev,workloads.kueue.x-k8s.io", "--all", "-n", namespace,
                        "--wait=false", "--ignore-not-found", check=False)
        kueue_manager.delete_made()
