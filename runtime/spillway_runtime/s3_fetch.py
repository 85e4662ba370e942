"""A job's s3:// inputs into a node's cache, before its training pods start.

Where this sits: run as `python -m spillway_runtime.s3_fetch --root DIR URI...` in the short
pod the operator starts on each node an attempt will use (`spillway_operator.s3_inputs`),
with no GPU, so that a download of many GB never holds one. It calls `objectstore.fetch`
for each URI into the node-local cache (a hostPath the training pods then mount read-only):
the ETag manifest makes a second job on the same objects and node download nothing, and
its file lock keeps two fetch pods on one node from tearing each other's files. The
result goes back as the container's termination message: one JSON line per URI (objects,
downloaded, cached, bytes, seconds) on success; `error: ...` naming the bucket and the
Secret to check on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spillway_runtime.objectstore import Endpoint, ObjectStoreError, fetch

# What the kubelet keeps of a termination message.
MESSAGE_LIMIT = 4096


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillway_runtime.s3_fetch", description=__doc__)
    parser.add_argument("uris", nargs="+")
    parser.add_argument("--root", type=Path, required=True, help="the cache directory")
    parser.add_argument("--endpoint", help="spec.storage.endpointUrl")
    parser.add_argument("--region", help="spec.storage.region")
    parser.add_argument("--secret", help="spec.storage.secretRef.name, for messages")
    parser.add_argument("--out", type=Path, default=Path("/dev/termination-log"))
    args = parser.parse_args(argv)
    where = Endpoint(args.endpoint, args.region, args.secret)
    if args.root.is_dir() and not os.access(args.root, os.W_OK):
        return _fail(args.out, f"the node's S3 cache ({args.root}, a subPath the kubelet made with the mode of "
                     f"the chart's operator.s3CacheHostPath) is not writable by uid {os.getuid()}: the chart's node "
                     "probe leaves that directory mode 1777; on a node it does not run on, make it so (chmod 1777)")
    lines = []
    for uri in args.uris:
        try:
            result = fetch(uri, root=args.root, where=where)
        except ObjectStoreError as err:
            return _fail(args.out, str(err))
        fields = result.event_fields()
        fields.pop("path")
        print(json.dumps({"event": "fetched", **fields}), flush=True)
        lines.append(json.dumps(fields, separators=(",", ":")))
    args.out.write_bytes("\n".join(lines).encode()[:MESSAGE_LIMIT])
    return 0


def _fail(out: Path, why: str) -> int:
    message = f"error: {why}"
    out.write_bytes(message.encode()[:MESSAGE_LIMIT])
    print(message, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
