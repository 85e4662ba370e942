"""docker/deepspeed.lock, the pins the training image's slow layer is built from, agrees
with requirements.lock and holds everything torch and DeepSpeed need there: a pin that
drifted would build the image with another version than the tests ran, and a missing one
would let pip choose any version in that layer."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version.strip()
    return out


def test_the_image_pins_are_the_lock_s_versions():
    image, lock = pins(ROOT / "docker" / "deepspeed.lock"), pins(ROOT / "requirements.lock")
    assert {"torch", "deepspeed"} <= image.keys()
    drifted = {name: (version, lock.get(name)) for name, version in image.items() if lock.get(name) != version}
    assert not drifted, f"docker/deepspeed.lock differs from requirements.lock (image, lock): {drifted}"


def test_the_image_pins_hold_what_torch_and_deepspeed_need():
    image = pins(ROOT / "docker" / "deepspeed.lock")
    needed, todo = set(), ["torch", "deepspeed"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in needed:
            continue
        needed.add(name)
        for text in metadata.distribution(name).requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    needed -= {"setuptools"}  # pinned on its own in the Dockerfile (a build tool there)
    assert not needed - image.keys(), f"add to docker/deepspeed.lock: {sorted(needed - image.keys())}"
