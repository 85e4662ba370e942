"""`spillway export`: any checkpoint of a run as a Hugging Face model directory (safetensors).

A run exports its model at its end (`recipe.export`); this takes the model of any kept
checkpoint (`step-400`, the one before a divergence, one restored from a mirror) without a
GPU, DeepSpeed engine or training process. The checkpoint is read as its resume reads it:
every file against its manifest's checksum, the optimizer's swap files included. It is
converted into DeepSpeed's universal form (`universal.write_universal`: one folder per
parameter with its whole fp32 master, whatever the number of processes, ZeRO stage or
placement that wrote it), and the masters, cast to the job's dtype, are loaded into the base
model's architecture and saved with its tokenizer, as the end of a run saves them. With LoRA
the masters are the adapters': they go onto the base as training put them, and the adapter
is saved in PEFT's layout (with `export.merge`, the merged model in `merged/` too).

`--universal` writes DeepSpeed's universal checkpoint instead (the form above, kept: one
folder per parameter with its fp32 master and Adam moments, and `latest_universal`), which
DeepSpeed's own tools and an engine with `checkpoint.load_universal` read whatever number of
processes and ZeRO stage load it.

A checkpoint in a mirror (spec.checkpoint.mirror: `s3://BUCKET/PREFIX`, its newest complete
one, or `s3://BUCKET/PREFIX/step-...`) is downloaded as a resume restores it (every file
against the manifest's sizes, into a temporary folder), then exported the same way.
"""

from __future__ import annotations

import functools
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from spillway_runtime.checkpoints import unpickle
from spillway_runtime.checkpoints.store import LATEST, PREFIX, CheckpointStore
from spillway_runtime.checkpoints.tensor_io import CheckpointIOError
from spillway_runtime.core.spec import FineTuneJobSpec


class ExportError(RuntimeError):
    """The checkpoint cannot be exported; the message says why and what to give instead."""


def checkpoint_dir(path: Path) -> Path:
    """A checkpoint's folder: `path` itself, or the newest of a run's `checkpoints` folder (or of
    a run folder holding one)."""
    for folder in (path, path / "checkpoints"):
        if (folder / LATEST).is_file():
            return folder / (folder / LATEST).read_text().strip()
    return path


def export_from_mirror(uri: str, out: Path, model_dir: Path | None = None,
                       endpoint_url: str | None = None, universal: bool = False) -> dict[str, Any]:
    """Export a mirrored checkpoint: `uri` is the mirror (its newest complete checkpoint) or one
    checkpoint in it. Credentials from the AWS variables; `endpoint_url` for a non-AWS server."""
    from spillway_runtime.checkpoints.mirror import Mirror
    from spillway_runtime.objectstore import Endpoint, ObjectStoreError

    mirror_uri, _, last = uri.rstrip("/").rpartition("/")
    named = re.fullmatch(re.escape(PREFIX) + r"\d+", last) is not None
    if not named:
        mirror_uri = uri.rstrip("/")
    if universal:
        _check_universal_out(out)  # before a download that may take hours
    try:
        mirror = Mirror(mirror_uri, where=Endpoint(url=endpoint_url))
        name = mirror.newest(last if named else None)
    except (ObjectStoreError, ValueError) as err:  # ValueError: not an s3:// URI it can parse
        raise ExportError(str(err)) from None
    if name is None:
        raise ExportError(f"{uri}: no complete checkpoint there" + (f" named {last}" if named else "")
                          + ": give the mirror's s3://BUCKET/PREFIX (spec.checkpoint.mirror) or a checkpoint in it")
    # Beside the output, not in /tmp: a checkpoint of a model that needs offloading is large
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".spillway-export-", dir=out.parent) as tmp:
        try:
            restored, _ = mirror.restore(name, Path(tmp))
        except ObjectStoreError as err:
            raise ExportError(str(err)) from None
        return export_universal(restored, out) if universal else export_checkpoint(restored, out, model_dir)


def export_universal(checkpoint: Path, out: Path) -> dict[str, Any]:
    """Write `checkpoint` as DeepSpeed's universal checkpoint into `out` (a new or empty folder):
    `out/ds/zero/<parameter>/{fp32,exp_avg,exp_avg_sq}.pt` and `out/latest_universal`."""
    from spillway_runtime.training.checkpointing import DS_TAG

    checkpoint = checkpoint_dir(checkpoint)
    store = CheckpointStore(checkpoint.parent, keep=1, log=lambda message: None)
    manifest = _checked_manifest(checkpoint, store)
    _check_universal_out(out)
    target = _universal(checkpoint, store, out)
    (out / "latest_universal").write_text(DS_TAG)
    parameters = sum(1 for folder in (target / "zero").iterdir() if (folder / "fp32.pt").is_file())
    return {"checkpoint": checkpoint.name, "step": manifest.get("step"), "parameters": parameters,
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def _check_universal_out(out: Path) -> None:
    """The universal checkpoint's folder is made anew (its writer clears it): a new or empty
    folder, never the current directory."""
    if out.resolve() == Path.cwd().resolve() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise ExportError(f"{out} is not an empty folder: give a new one for the universal checkpoint")


def _checked_manifest(checkpoint: Path, store: CheckpointStore) -> dict[str, Any]:
    """The checkpoint's manifest, once its files are all there as the manifest lists them."""
    manifest = store.read_manifest(checkpoint)
    if manifest is None:
        raise ExportError(f"{checkpoint} is not a Spillway checkpoint (no manifest.json): give a checkpoint's "
                          "folder (checkpoints/step-...), a run's checkpoints folder, or a run folder")
    problem = store.verify(checkpoint, deep=False)
    if problem is not None:
        raise ExportError(f"checkpoint {checkpoint.name} is damaged: {problem}")
    if ((manifest.get("config") or {}).get("offload") or {}).get("overlap") == "zenflow":
        raise ExportError(
            f"checkpoint {checkpoint.name} was written with offload.overlap zenflow, which keeps the optimizer state "
            "column by column; DeepSpeed's universal converter reads it row by row and the weights would come out "
            "scrambled. The run's own export (its final/ folder) holds the model at its last step")
    return manifest


def export_checkpoint(checkpoint: Path, out: Path, model_dir: Path | None = None) -> dict[str, Any]:
    """Write `checkpoint`'s model to `out` (safetensors, config, tokenizer); `model_dir` is the
    base model the job trained (default: the job's model.uri, when it is a local directory).
    Returns what was written: step, parameters, bytes."""
    import os

    # DeepSpeed's converter and transformers' loading and writing draw tqdm bars: one line says it
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import torch
    from transformers import AutoTokenizer

    from spillway_runtime.training.lora import MERGED_DIR, save_merged

    checkpoint = checkpoint_dir(checkpoint)
    store = CheckpointStore(checkpoint.parent, keep=1, log=lambda message: None)
    manifest = _checked_manifest(checkpoint, store)
    spec = FineTuneJobSpec.model_validate(manifest.get("config") or {})
    base = model_dir or _recorded(manifest, "modelDir") or Path(spec.model.uri.removeprefix("file://"))
    if not (base / "config.json").is_file():
        raise ExportError(f"the base model {str(base)!r} (the job's model.uri) is not a local model directory here: "
                          "give it with --model")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[spec.model.dtype]
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".spillway-export-", dir=out))
    try:
        masters = _masters(checkpoint, store, scratch)
        model = _trained_model(base, spec, dtype, masters, checkpoint.name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)  # with LoRA: the adapter, in PEFT's layout
    tokenizer_dir = (_recorded(manifest, "tokenizerDir") or Path(spec.model.tokenizer_uri.removeprefix("file://"))
                     if spec.model.tokenizer_uri else base)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(out)
    if spec.method.lora and spec.export.merge:
        save_merged(base, out, out / MERGED_DIR, dtype, tokenizer)
    return {"checkpoint": checkpoint.name, "step": manifest.get("step"), "parameters": len(masters),
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def _universal(checkpoint: Path, store: CheckpointStore, out: Path) -> Path:
    """The checkpoint read as a resume reads it (each file against its checksum, swap files
    included) and written in DeepSpeed's universal form into `out`; returns `out/ds`."""
    from spillway_runtime.checkpoints.engine import SpillwayCheckpointEngine, direct_io, read_swap_file
    from spillway_runtime.checkpoints.universal import UniversalError, write_universal
    from spillway_runtime.core.hardware import AioSettings, memlock_limit
    from spillway_runtime.training.checkpointing import DS_TAG

    engine = SpillwayCheckpointEngine(direct_io(AioSettings(), memlock_limit(), checkpoint))
    engine.expected = store.deferred(checkpoint)
    try:
        return write_universal(checkpoint, DS_TAG, out, engine.load, functools.partial(read_swap_file, engine))
    except (CheckpointIOError, UniversalError) as err:
        raise ExportError(f"checkpoint {checkpoint.name} could not be read: {err}") from None


def _masters(checkpoint: Path, store: CheckpointStore, scratch: Path) -> dict[str, Any]:
    """Every parameter's whole fp32 master, by name, from the checkpoint's universal form."""
    universal = _universal(checkpoint, store, scratch)
    return {folder.name: unpickle.load(folder / "fp32.pt")["param"]
            for folder in (universal / "zero").iterdir() if (folder / "fp32.pt").is_file()}


def _trained_model(base: Path, spec: FineTuneJobSpec, dtype: Any, masters: dict[str, Any], checkpoint: str) -> Any:
    """The base model's architecture with the masters in it, cast to the job's dtype (with
    LoRA: the adapters on the base, as training put them); refused, naming what does not
    match, when the checkpoint is of another model."""
    from transformers import AutoModelForCausalLM

    from spillway_runtime.training.lora import lora_config

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    if spec.method.lora:  # the checkpoint holds the adapters' masters: put them on the base as training did
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(spec.method), autocast_adapter_dtype=False)
    current = model.state_dict()
    unknown = sorted(set(masters) - set(current))
    if unknown:
        raise ExportError(f"checkpoint {checkpoint} holds parameters the model at {base} has not "
                          f"({', '.join(unknown[:3])}...): give the job's base model with --model")
    missing = model.load_state_dict({n: t.to(current[n].dtype) for n, t in masters.items()}, strict=False).missing_keys
    tied = set(getattr(model, "_tied_weights_keys", None) or []) | _tied_names(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad} if spec.method.lora else set()
    untrained = [name for name in missing if name not in tied and name not in frozen]
    if untrained:
        raise ExportError(f"checkpoint {checkpoint} lacks {', '.join(untrained[:3])} of the model at {base}: "
                          "give the job's base model with --model")
    return model


def _recorded(manifest: dict[str, Any], key: str) -> Path | None:
    """The base model's (or tokenizer's) folder as the run that wrote the checkpoint found it,
    when it is on this machine (a pod's mount point is not)."""
    folder = manifest.get(key)
    return Path(folder) if folder and Path(folder).is_dir() else None


def _tied_names(model: Any) -> set[str]:
    """The names of parameters that are another's (an output embedding tied to the input one):
    of a parameter reached under several names, every name but the first."""
    first: dict[int, str] = {}  # id of a parameter -> the name it is reached under first
    aliases: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            aliases.add(name)
    return aliases
