"""The model's `config.json`, read where the model lives, cut to what planning needs.

Where this sits: run as `python -m spillway_runtime.core.model_config DIR --out FILE` in the
short pod the operator starts before it plans a cluster job whose model sits on a volume
(`pvc://`) and whose spec gives no `model.config` (`spillway_operator.model_config`). The
pod's termination message carries the result back, and the kubelet keeps at most 4096
bytes of it: nested objects (`id2label`, `rope_scaling`, `quantization_config`) and lists
other than lists of layer numbers are left out, as the parameter count never reads them.
Standard library only: the pod runs this before anything heavy is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# What the kubelet keeps of a termination message.
MESSAGE_LIMIT = 4096
LONG_STRING = 200


class ModelConfigError(ValueError):
    """The directory's config.json cannot be planned from; the message says why."""


def _kept(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= LONG_STRING
    if isinstance(value, list):
        return all(isinstance(item, int) and not isinstance(item, bool) for item in value)
    return value is None or isinstance(value, (bool, int, float))


def planning_config(model_dir: Path) -> dict[str, Any]:
    """`model_dir/config.json` without what planning never reads; raises ModelConfigError."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        listing = sorted(p.name for p in model_dir.iterdir())[:10] if model_dir.is_dir() else None
        where = f"the directory holds {listing}" if listing is not None else f"{model_dir} is not a directory"
        raise ModelConfigError(f"{path} does not exist ({where})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelConfigError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    config = {key: value for key, value in raw.items() if _kept(value)}
    size = len(encode(config))
    if size > MESSAGE_LIMIT:
        raise ModelConfigError(f"{path}'s plain fields take {size} bytes, more than the {MESSAGE_LIMIT} a pod's "
                               "termination message holds: give the config inline as spec.model.config")
    return config


def encode(config: dict[str, Any]) -> bytes:
    return json.dumps(config, separators=(",", ":"), sort_keys=True).encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spillway_runtime.core.model_config", description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/dev/termination-log"))
    args = parser.parse_args(argv)
    try:
        data = encode(planning_config(args.model_dir))
    except ModelConfigError as err:
        data = f"error: {err}".encode()[:MESSAGE_LIMIT]
        args.out.write_bytes(data)
        print(data.decode(errors="replace"), file=sys.stderr)
        return 1
    args.out.write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
