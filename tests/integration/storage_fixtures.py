"""A real S3 server for the tests: SeaweedFS's `weed server -s3` on loopback, built by
hack/weed (from the Go module proxy, cached by a hash of its inputs), with free ports, a
temporary data directory and one identity whose keys the tests hand to `spillway run`
through the usual AWS variables. Import the fixture into a test module to use it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ACCESS_KEY = "spillway-test"
SECRET_KEY = "spillway-test-secret-key-0123456789"


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    log: Path
    ports: tuple[int, ...] = ()  # weed's eight, to start it again at the same address

    def env(self, *, secret_key: str | None = None) -> dict[str, str]:
        """The AWS variables `spillway run` reads (a wrong secret for the refusal tests)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": secret_key or self.secret_key, "AWS_REGION": "us-east-1"}

    def store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, access_key_id=self.access_key,
                       secret_access_key=self.secret_key, region="us-east-1", client_options={"allow_http": True})

    def upload(self, bucket: str, prefix: str, source: Path) -> int:
        """A file to the key `prefix`, or a directory's files under `prefix/` (the bucket is
        made on the first upload: weed's auto-create for admin identities). Returns bytes."""
        import obstore

        store = self.store(bucket)
        files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
        for file in files:
            key = prefix if source.is_file() else f"{prefix.rstrip('/')}/{file.relative_to(source).as_posix()}"
            obstore.put(store, key, file.read_bytes())
        return sum(f.stat().st_size for f in files)


def _free_ports(count: int) -> list[int]:
    """Ports free now on 127.0.0.1, held open together so that none repeats."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def weed_binary() -> Path:
    """hack/weed's binary, built first if missing (a hash check when it is there)."""
    path = Path(subprocess.run([str(ROOT / "hack" / "weed"), "path"], check=True, capture_output=True,
                               text=True).stdout.strip())
    if not path.is_file():
        subprocess.run([str(ROOT / "hack" / "weed"), "build"], check=True)
    return path


def _answers(endpoint: str) -> bool:
    """The S3 gateway lists buckets for our identity (it answers before the filer is ready)."""
    import obstore
    from obstore.store import S3Store

    store = S3Store("spillway-ready", endpoint=endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                    region="us-east-1", client_options={"allow_http": True, "timeout": "3s"},
                    retry_config={"max_retries": 0})
    try:
        obstore.put(store, "ready", b"ok")
        return True
    except Exception:  # not up yet, whatever the reason
        return False


def weed_command(root: Path, ip: str, ports: tuple[int, ...], volumes: int = 16) -> list[str]:
    """`weed server -s3` on `ip` with its data, sockets and identities (our one test key)
    under `root`; `ports`: master, its gRPC, volume, its gRPC, filer, its gRPC, S3, its gRPC."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    config = root / "identities.json"
    config.write_text(json.dumps({"identities": [{
        "name": "spillway-test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}))
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = ports
    return [
        str(weed_binary()), "server", f"-dir={root / 'data'}", f"-ip={ip}", f"-ip.bind={ip}",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", "-master.volumeSizeLimitMB=64",
        "-master.telemetry=false", f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-volume.max={volumes}", "-filer", f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={root / 'filer.sock'}", "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}", f"-s3.localSocket={root / 's3.sock'}",
    ]


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to a server started in its own session (it and the workers it started), then
    SIGKILL after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


@contextlib.contextmanager
def serving(command: list[str], log: Path, answers: Callable[[], bool], what: str, *, timeout: float,
            grace: float, **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """`command` in its own session, its output appended to `log`, until `answers()` (else
    an error with the log's tail after `timeout` seconds or at its exit); stopped at the end."""
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + timeout
        while not answers():
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited {proc.returncode}: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer in {timeout:.0f} s: {log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield proc
    finally:
        stop(proc, grace)


@contextlib.contextmanager
def weed_server(root: Path, ports: tuple[int, ...] = (), volumes: int = 16) -> Iterator[S3Server]:
    """`weed server -s3` with its data under `root`, until the block ends (the benchmark
    uses it as is; the tests through the `s3_server` fixture). `ports`: those of an earlier
    server on the same `root`, to bring it back where its clients look. `volumes`: of 64 MiB
    each, what the server can hold (deleted objects' space comes back only at a vacuum)."""
    ports = ports or tuple(_free_ports(8))
    command = weed_command(root, "127.0.0.1", ports, volumes)
    log = root / "weed.log"
    endpoint = f"http://127.0.0.1:{ports[6]}"
    with serving(command, log, lambda: _answers(endpoint), f"weed server on {endpoint}", timeout=90, grace=2,
                 cwd=root):
        yield S3Server(endpoint, ACCESS_KEY, SECRET_KEY, log, ports)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    with weed_server(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
