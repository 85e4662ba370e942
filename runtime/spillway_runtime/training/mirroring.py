"""The recipe's checkpoint mirror (`spec.checkpoint.mirror`, and `spec.export.uri`'s bucket):
checked writable before training, its newest checkpoint brought onto an empty volume, and the
uploader started. `Checkpointing` holds what `open_mirror` returns and reports its news.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training import k8s_status
from spillway_runtime.training.run import RunFailed, TrainingRun

if TYPE_CHECKING:
    from spillway_runtime.checkpoints.mirror import CheckpointMirror, Mirror
    from spillway_runtime.checkpoints.store import CheckpointStore


def open_mirror(run: TrainingRun, store: CheckpointStore) -> CheckpointMirror | None:
    """spec.checkpoint.mirror: check it can be written (a wrong Secret or bucket fails
    the job now, exit 2), bring its newest checkpoint onto an empty volume (or the one
    resumeFrom names, when the volume lacks it), then start the uploader (rank 0). None:
    no mirror, or not rank 0."""
    from spillway_runtime.checkpoints.mirror import CheckpointMirror, Mirror, check_writable
    from spillway_runtime.objectstore import Endpoint, ObjectStoreError, S3Location, open_store

    uri, export = run.spec.checkpoint.mirror, run.spec.export.uri
    if uri is None and export is None:
        return None
    problem: str | None = None
    mirror: Mirror | None = None
    if run.rank == 0:
        where = Endpoint.of(run.spec.storage, in_pod=k8s_status.in_pod())
        field = "export.uri"
        try:
            if export is not None:
                loc = S3Location.parse(export)
                check_writable(open_store(loc.bucket, where), loc, where)
            if uri is not None:
                field = "checkpoint.mirror"
                mirror = Mirror(uri, where=where)
                mirror.check()
                _restore(run, store, mirror)
        except ObjectStoreError as err:
            problem = f"{field}: {err}"
    problem = run.ranks.first_failure(problem)
    if problem is not None:
        raise RunFailed(problem, ExitCode.BAD_INPUT)
    if mirror is None:
        return None
    return CheckpointMirror(mirror, run.spec.checkpoint.keep, spared=lambda: {c.name for c in store.list()})


def _restore(run: TrainingRun, store: CheckpointStore, mirror: Mirror) -> None:
    wanted = run.spec.resume_from
    local = {c.name for c in store.list()}
    if local and (wanted is None or wanted in local or store.applied_rollback() == wanted):
        return
    name = mirror.newest(wanted if wanted not in local else None)
    if name is None:
        run.log(f"checkpoint.mirror {mirror.uri} holds no complete checkpoint"
                + (f" named {wanted}" if wanted else "") + "; starting from the volume")
        return
    started = time.monotonic()
    _path, nbytes = mirror.restore(name, store.root)
    seconds = time.monotonic() - started
    run.reporter.event("mirror_restored", checkpoint=name, uri=mirror.uri, bytes=nbytes,
                       seconds=round(seconds, 3), bytes_per_s=round(nbytes / max(seconds, 1e-6)))
