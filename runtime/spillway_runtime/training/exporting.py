"""The run's model at the end of training: consolidated from ZeRO's shards into a Hugging Face
folder (safetensors), the LoRA adapter (and with `export.merge` the merged model), uploaded to
`export.uri` when the job names one. (`spillway export` does the same from any checkpoint:
`spillway_runtime.export`.)
"""

from __future__ import annotations

import time
from pathlib import Path

from spillway_runtime.training import disk_usage, k8s_status
from spillway_runtime.training.lora import MERGED_DIR, save_merged
from spillway_runtime.training.run import RunFailed, TrainingRun


def export(run: TrainingRun) -> None:
    """Consolidate ZeRO shards into a Hugging Face directory (safetensors). With LoRA: the
    adapter (PEFT's layout: `PeftModel.from_pretrained` loads it onto the base model),
    and with `export.merge` the merged model in `merged/` too."""
    zero3 = run.plan.zero_stage == 3
    if zero3:
        state_dict = run.engine._zero3_consolidated_16bit_state_dict()
    else:  # ZenFlow's matrices are column-ordered views of its flat buffer (safetensors wants them whole)
        state_dict = {name: t.contiguous() for name, t in run.engine.module.state_dict().items()}
    if run.rank == 0:
        out = Path(run.cfg.export_dir)
        out.mkdir(parents=True, exist_ok=True)
        run.engine.module.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        run.tokenizer.save_pretrained(out)
        if run.spec.method.lora and run.spec.export.merge:
            _merged(run, out, out / MERGED_DIR)
        run.reporter.event("exported", path=str(out), bytes=disk_usage.dir_bytes(out))
        if run.spec.export.uri:
            _upload(run, out, run.spec.export.uri)
    run.ranks.barrier()


def _upload(run: TrainingRun, out: Path, uri: str) -> None:
    """The exported model to spec.export.uri; a failure fails the run (its checkpoints
    stay, and a restart exports and uploads again)."""
    from spillway_runtime.checkpoints.mirror import upload_directory
    from spillway_runtime.objectstore import Endpoint, ObjectStoreError

    started = time.monotonic()
    try:
        nbytes = upload_directory(uri, out, Endpoint.of(run.spec.storage, in_pod=k8s_status.in_pod()))
    except ObjectStoreError as err:
        raise RunFailed(f"export.uri: {err}") from None
    seconds = time.monotonic() - started
    run.reporter.event("export_uploaded", uri=uri, bytes=nbytes, seconds=round(seconds, 3),
                       bytes_per_s=round(nbytes / max(seconds, 1e-6)))


def _merged(run: TrainingRun, adapter: Path, target: Path) -> None:
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # a plain load, not partitioned by ZeRO-3 (training is over)
    save_merged(Path(run.cfg.model_dir), adapter, target, run.torch_dtype, run.tokenizer)
