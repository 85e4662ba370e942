"""Download throughput of `spillway run`'s S3 cache fill, and upload and restore throughput
of the checkpoint mirror, each against a plain boto3 copy of the same objects, in the same
run, from and to a real SeaweedFS server on loopback.

    python benchmarks/bench_s3.py [--big-mib 192] [--files 16] [--file-mib 4] [--rounds 2]

Starts `weed server -s3` (hack/weed, as the tests do), uploads a model-like prefix (one
big weights file and several small ones), then alternates, `--rounds` times: boto3's
`download_file` of every object one after another (the plain copy a user would write),
and `objectstore.fetch` into an empty cache (listing, parallel downloads with the big file
in ranged parts, temp file + fsync + rename, manifest; boto3 does not fsync). Prints each
one's MiB/s (best round) and their ratio; also the time of a fetch that finds everything
cached. Then the same for a checkpoint-like directory (the big file and the small ones
with a manifest): boto3's `upload_file` one by one against `Mirror.upload` (files in
parallel, big ones in multipart parts, manifest last), and `download_file` against
`Mirror.restore` (staging directory, fsync, rename). No assertions. On loopback with 2
shared cores weed and the client compete for the CPU, so the ratios vary from run to run
(downloads 0.8x-1.14x seen; 1.28x with fsync skipped).

boto3 is not in the project's lock (its botocore pins python-dateutil<3, which the
pinned kubernetes client excludes), so the baseline runs in a child process with
boto3 1.44.8 installed once into $SPILLWAY_CACHE/bench-boto3 (pip --target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spillway_runtime.objectstore import fetch  # noqa: E402
from tests.integration.storage_fixtures import S3Server, weed_server  # noqa: E402

BOTO3 = "boto3==1.44.8"
BUCKET = "bench"

# The plain copy a user would write: boto3's download_file or upload_file, one object after another.
BASELINE = r"""
import json, sys, time
import boto3
args = json.loads(sys.argv[1])
s3 = boto3.client("s3", endpoint_url=args["endpoint"], aws_access_key_id=args["key"],
                  aws_secret_access_key=args["secret"], region_name="us-east-1")
start = time.perf_counter()
for key in args.get("keys", []):
    s3.download_file(args["bucket"], key, args["out"] + "/" + key.replace("/", "_"))
for rel in args.get("files", []):
    s3.upload_file(args["root"] + "/" + rel, args["bucket"], args["prefix"] + "/" + rel)
print(time.perf_counter() - start)
"""


def boto3_path() -> Path:
    target = Path(os.environ.get("SPILLWAY_CACHE", Path.home() / ".cache" / "spillway")) / "bench-boto3"
    stamp = target / f".{BOTO3}"
    if not stamp.exists():
        print(f"installing {BOTO3} into {target} (once)", file=sys.stderr)
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), BOTO3], check=True)
        stamp.touch()
    return target


def upload(server: S3Server, big_mib: int, files: int, file_mib: int) -> tuple[list[str], int]:
    import obstore

    store = server.store(BUCKET)
    objects = {"model/model.safetensors": big_mib << 20}
    objects.update({f"model/shard-{i:02d}.bin": file_mib << 20 for i in range(files)})
    objects["model/config.json"] = 700
    for key, size in objects.items():
        obstore.put(store, key, os.urandom(size))
    return sorted(objects), sum(objects.values())


def boto3_seconds(server: S3Server, site: Path, **args: Any) -> float:
    """The baseline's seconds, in a child process with boto3 on its path: `keys` and `out`
    to download, or `files`, `root` and `prefix` to upload."""
    args.update(endpoint=server.endpoint, key=server.access_key, secret=server.secret_key, bucket=BUCKET)
    done = subprocess.run([sys.executable, "-c", BASELINE, json.dumps(args)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(site)})
    if done.returncode:
        raise RuntimeError(f"the boto3 baseline failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def plain_boto3(server: S3Server, keys: list[str], out: Path, site: Path) -> float:
    out.mkdir(parents=True)
    return boto3_seconds(server, site, keys=keys, out=str(out))


def cache_fill(server: S3Server, root: Path) -> tuple[float, float]:
    os.environ.update(server.env())
    start = time.perf_counter()
    first = fetch(f"s3://{BUCKET}/model", root=root)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    again = fetch(f"s3://{BUCKET}/model", root=root)
    warm = time.perf_counter() - start
    assert first.downloaded == first.objects and again.downloaded == 0
    return cold, warm


def checkpoint_dir(root: Path, big_mib: int, files: int, file_mib: int) -> tuple[Path, list[str], int]:
    """A committed checkpoint as the mirror sees it: files and a manifest naming them."""
    from spillway_runtime.checkpoints.store import MANIFEST

    path = root / "step-00000010"
    path.mkdir(parents=True)
    sizes = {"mp_rank_00_model_states.pt": big_mib << 20}
    sizes.update({f"zero_pp_rank_{i}_optim_states.pt": file_mib << 20 for i in range(files)})
    for rel, size in sizes.items():
        (path / rel).write_bytes(os.urandom(size))
    manifest = {"name": path.name, "step": 10, "files": {rel: {"size": n, "sha256": "-"} for rel, n in sizes.items()}}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path, [*sorted(sizes), MANIFEST], sum(sizes.values())


def plain_boto3_upload(server: S3Server, root: Path, files: list[str], prefix: str, site: Path) -> float:
    return boto3_seconds(server, site, files=files, root=str(root), prefix=prefix)


def mirror_round(server: S3Server, ckpt: Path, files: list[str], tmp: Path, r: int, site: Path) -> dict[str, float]:
    from spillway_runtime.checkpoints.mirror import Mirror

    mirror = Mirror(f"s3://{BUCKET}/mirror-{r}", store=server.store(BUCKET))
    times = {"boto3 up": plain_boto3_upload(server, ckpt, files, f"plain-{r}/{ckpt.name}", site)}
    start = time.perf_counter()
    mirror.upload(ckpt)
    times["mirror up"] = time.perf_counter() - start
    keys = [f"mirror-{r}/{ckpt.name}/{rel}" for rel in files]
    times["boto3 down"] = plain_boto3(server, keys, tmp / f"plain-down-{r}", site)
    start = time.perf_counter()
    mirror.restore(ckpt.name, tmp / f"restored-{r}")
    times["mirror down"] = time.perf_counter() - start
    # weed's test volumes hold about 1 GiB: each round leaves nothing behind
    import obstore

    store = server.store(BUCKET)
    keys = [str(m["path"]) for prefix in (f"plain-{r}/", f"mirror-{r}/") for batch in obstore.list(store, prefix=prefix)
            for m in batch]
    obstore.delete(store, keys)
    shutil.rmtree(tmp / f"plain-down-{r}")
    shutil.rmtree(tmp / f"restored-{r}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-mib", type=int, default=192)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--file-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    opts = parser.parse_args()
    site = boto3_path()
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp, weed_server(Path(tmp) / "weed", volumes=64) as server:
        keys, total = upload(server, opts.big_mib, opts.files, opts.file_mib)
        mib = total / (1 << 20)
        plain, ours, warm = [], [], []
        for r in range(opts.rounds):
            plain.append(plain_boto3(server, keys, Path(tmp) / f"plain-{r}", site))
            cold, cached = cache_fill(server, Path(tmp) / f"cache-{r}")
            ours.append(cold)
            warm.append(cached)
            shutil.rmtree(Path(tmp) / f"plain-{r}")
            shutil.rmtree(Path(tmp) / f"cache-{r}")
        import obstore

        obstore.delete(server.store(BUCKET), keys)  # room for the checkpoint rounds
        print(f"{len(keys)} objects, {mib:.0f} MiB, from weed on loopback, best of {opts.rounds}")
        print(f"plain boto3 download_file, one by one: {mib / min(plain):8.1f} MiB/s  ({min(plain):.2f} s)")
        print(f"spillway cache fill (objectstore.fetch): {mib / min(ours):8.1f} MiB/s  ({min(ours):.2f} s)")
        print(f"ratio cache fill / plain boto3:          {min(plain) / min(ours):8.2f}x")
        print(f"a second fetch, everything cached:       {min(warm) * 1000:8.1f} ms")
        ckpt, files, size = checkpoint_dir(Path(tmp) / "volume", opts.big_mib, opts.files, opts.file_mib)
        rounds = [mirror_round(server, ckpt, files, Path(tmp), r, site) for r in range(opts.rounds)]
        best = {k: min(t[k] for t in rounds) for k in rounds[0]}
        mib = size / (1 << 20)
        print(f"checkpoint of {len(files)} files, {mib:.0f} MiB, best of {opts.rounds}")
        for label, key in (("plain boto3 upload_file, one by one:", "boto3 up"),
                           ("mirror upload (Mirror.upload):", "mirror up"),
                           ("plain boto3 download_file, one by one:", "boto3 down"),
                           ("mirror restore (Mirror.restore):", "mirror down")):
            print(f"{label:40s} {mib / best[key]:8.1f} MiB/s  ({best[key]:.2f} s)")
        print(f"ratio mirror upload / plain boto3:       {best['boto3 up'] / best['mirror up']:8.2f}x")
        print(f"ratio mirror restore / plain boto3:      {best['boto3 down'] / best['mirror down']:8.2f}x")


if __name__ == "__main__":
    main()
