"""A dataset is tokenized into its cache as it is read: the memory that takes does not grow
with the dataset, so one larger than RAM trains (its tokens are then mapped from the cache).

Measured in a child process: each format's dataset is built small, then 4x as large, and each
build's rise of the peak resident set over what was resident before it (Linux's VmHWM, reset
through /proc/self/clear_refs) is compared: the large one's may exceed the small one's by a
sliver of the tokens it adds, not by them. Before the cache streamed, every
text (or record's token lists) and every token was in memory at once, and the large build
raised the peak by about 3x its tokens' bytes (a measured 34 MB for 8 MB of tokens)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from spillway_runtime.tiny import build_tiny_model, synthetic_texts

# Records: a warm-up build (first calls allocate what later ones reuse), small, then 4x as large.
SIZES = {"jsonl": (1_000, 20_000, 80_000), "completion": (1_000, 5_000, 20_000), "preference": (1_000, 5_000, 20_000)}
SEQUENCE = 64

CHILD = r"""
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
from spillway_runtime.core.spec_inputs import DatasetSource
from spillway_runtime.training.data import tokenize_sources

model, out = Path(sys.argv[1]), Path(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model)

def status(name):
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(name + ":"))
    return int(line.split()[1]) * 1024

report = []
for fmt, data in json.loads(sys.argv[3]):
    data = Path(data)
    source = DatasetSource(uri=str(data), format=fmt)
    cache = out / data.name / "tokens-x.json"
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from now
    before = status("VmRSS")
    dataset, _ = tokenize_sources(source, [(data, 1.0, "spec.dataset.uri")], tokenizer, SEQUENCE, 0, cache)
    size = sum(f.stat().st_size for f in cache.parent.iterdir() if f.suffix in (".ids", ".meta"))
    report.append({"data": data.name, "rows": len(dataset), "cache_bytes": size, "rise_bytes": status("VmHWM") - before})
print(json.dumps(report))
""".replace("SEQUENCE", str(SEQUENCE))


def _records(fmt: str, count: int) -> list[dict[str, str]]:
    texts = synthetic_texts(count, seed=count)
    if fmt == "jsonl":
        return [{"text": t} for t in texts]
    questions = [t.split(" Answer: ") for t in texts]
    if fmt == "completion":
        return [{"prompt": q, "completion": " " + a} for q, a in questions]
    return [{"prompt": q, "chosen": " " + a, "rejected": " I do not know."} for q, a in questions]


def _write(path: Path, records: list[dict[str, str]]) -> Path:
    with gzip.open(path, "wt") as fh:  # read as it decompresses
        fh.writelines(json.dumps(r) + "\n" for r in records)
    return path


def test_tokenizing_a_dataset_takes_memory_that_does_not_grow_with_it(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model", hidden_size=32, layers=1, heads=2)
    datasets = [[fmt, str(_write(tmp_path / f"{fmt}-{n}.jsonl.gz", _records(fmt, n)))]
                for fmt, sizes in SIZES.items() for n in sizes]  # texts joined; documents; pairs
    child = subprocess.run([sys.executable, "-c", CHILD, str(model), str(tmp_path / "caches"), json.dumps(datasets)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    for fmt, small, large in zip(SIZES, report[1::3], report[2::3], strict=True):
        assert large["rows"] > 3 * small["rows"]  # 4x the records: about 4x the rows
        grown = large["rise_bytes"] - small["rise_bytes"]
        added = large["cache_bytes"] - small["cache_bytes"]
        print(f"{fmt}: cache {small['cache_bytes'] / 2**20:.1f} -> {large['cache_bytes'] / 2**20:.1f} MiB, "
              f"peak RSS +{grown / 2**20:.2f} MiB")
        assert grown < added / 8, f"{fmt}: the peak grew by {grown} B for {added} B more of tokens"
