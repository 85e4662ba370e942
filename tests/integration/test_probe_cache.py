"""`spillway run`'s planning with the disk's async-I/O sweep: the first run on NVMe measures
it (a short real sweep here), later runs on the same disk reuse it, a changed machine or an
old entry is measured again, and the settings are the run's DeepSpeed `aio` block."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spillway_runtime.core.hardware import AioSettings, matmul_rate_at
from spillway_runtime.local import prepare_local_run
from spillway_runtime.probe import probe_basic
from spillway_runtime.probe_cache import (
    AIO_PROBE_VERSION,
    DAY_SECONDS,
    ComputeEntry,
    ProbeCacheSettings,
    ProbeEntry,
    entry_path,
    fingerprint,
    read_entry,
    store_entry,
)
from spillway_runtime.training.reporting import read_events

AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own cache (the session's may hold another test's entry), and a sweep of
    one or two settings on 8 MiB: a test checks where figures go, not how fast the disk is."""
    monkeypatch.setenv("SPILLWAY_PROBE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPILLWAY_PROBE_AIO_SECONDS", "0.1")
    monkeypatch.setenv("SPILLWAY_PROBE_SWEEP", "1")
    monkeypatch.setenv("SPILLWAY_PROBE_AIO_IO_MIB", "8")
    monkeypatch.setenv("SPILLWAY_PROBE_COMPUTE", "0")  # its own test below: it loads DeepSpeed's CPU Adam op
    return tmp_path / "cache"


def nvme_job(make_job, tmp_path: Path, name: str) -> Path:
    return make_job(name, offload={"optimizer": "nvme", "nvme": {"path": str(tmp_path / name / "nvme")}})


def aio_block(config) -> tuple[int, int, int]:
    return tuple(config.deepspeed["aio"][k] for k in AIO_KEYS)


def probe_events(run_dir: str) -> list[dict]:
    return [e for e in read_events(Path(run_dir) / "events.jsonl") if e["event"] == "probe"]


@pytest.mark.integration
def test_the_first_run_on_nvme_measures_the_disk_and_the_next_reuses_it(make_job, tmp_path, cache) -> None:
    first = prepare_local_run(nvme_job(make_job, tmp_path, "first"), run_dir=tmp_path / "run1")
    assert first.probe is not None and first.probe.source == "measured", first.probe
    entry = read_entry(Path(first.probe.cache_file))
    assert entry is not None and entry.hardware.aio is not None and Path(first.probe.cache_file).parent == cache
    measured_at = entry.measured_at
    assert aio_block(first) == tuple(getattr(entry.hardware.aio, k) for k in AIO_KEYS)
    assert first.plan.aio == entry.hardware.aio
    [event] = probe_events(first.run_dir)
    assert event["source"] == "measured" and event["aio"]["block_size"] == entry.hardware.aio.block_size

    # Another job, another NVMe directory on the same disk: no sweep, the same settings.
    second = prepare_local_run(nvme_job(make_job, tmp_path, "second"), run_dir=tmp_path / "run2")
    assert second.probe is not None and second.probe.source == "cached"
    again = read_entry(Path(second.probe.cache_file))
    assert again is not None and again.measured_at == measured_at
    assert aio_block(second) == aio_block(first)
    assert [e["source"] for e in probe_events(second.run_dir)] == ["cached"]

    # Asked to: measured again, and the entry is replaced.
    third = prepare_local_run(nvme_job(make_job, tmp_path, "second"), run_dir=tmp_path / "run2", reprobe=True)
    assert third.probe is not None and third.probe.source == "measured" and "re-probe" in third.probe.why
    replaced = read_entry(Path(third.probe.cache_file))
    assert replaced is not None and replaced.measured_at > measured_at


@pytest.mark.integration
def test_a_cached_entry_is_the_runs_aio_until_the_machine_changes_or_it_ages(make_job, tmp_path, cache) -> None:
    job = nvme_job(make_job, tmp_path, "seeded")
    nvme = tmp_path / "seeded" / "nvme"
    hw = probe_basic(nvme)
    fp = fingerprint(nvme, hw)
    path = entry_path(ProbeCacheSettings(), fp)
    # Settings no sweep here would pick, so that the DeepSpeed config can only have them from the entry.
    seeded = AioSettings(block_size=2 << 20, queue_depth=48, intra_op_parallelism=3)

    def seed(**update) -> float:
        at = time.time() - 3600
        entry = ProbeEntry(fingerprint=fp, probe=AIO_PROBE_VERSION, measured_at=at, probe_seconds=2.0,
                           hardware=hw.model_copy(update={"aio": seeded, "nvme_read_bytes_per_s": 5e9,
                                                          "nvme_write_bytes_per_s": 4e9}))
        store_entry(path, entry.model_copy(update=update))
        return at

    seed()
    cached = prepare_local_run(job, run_dir=tmp_path / "run")
    assert cached.probe is not None and cached.probe.source == "cached"
    assert aio_block(cached) == (2 << 20, 48, 3)
    assert cached.probe.age_seconds is not None and cached.probe.age_seconds >= 3600

    seed(fingerprint=fp.model_copy(update={"disk_model": "a disk that was swapped out"}))
    changed = prepare_local_run(job, run_dir=tmp_path / "run")
    assert changed.probe is not None and changed.probe.source == "measured" and "disk_model" in changed.probe.why
    entry = read_entry(path)
    assert entry is not None and entry.fingerprint == fp and entry.hardware.aio != seeded
    assert aio_block(changed) == tuple(getattr(entry.hardware.aio, k) for k in AIO_KEYS)
    # the sweep's winner timed at a quarter of its 8 MiB too: the disk's cost per transfer, fitted
    # (none where an 8 MiB block leaves no smaller size to time)
    assert entry.probe == AIO_PROBE_VERSION
    cost = entry.hardware.nvme_transfer_seconds
    assert (cost is None) is (entry.hardware.aio.block_size >= 8 << 20) and (cost is None or 0 <= cost < 1)
    assert changed.probe.nvme_transfer_seconds == cost

    seed(probe=1)  # swept by a Spillway that fitted no cost per transfer
    older = prepare_local_run(job, run_dir=tmp_path / "run")
    assert older.probe is not None and older.probe.source == "measured" and "cost per transfer" in older.probe.why

    old = seed(measured_at=time.time() - 8 * DAY_SECONDS)
    aged = prepare_local_run(job, run_dir=tmp_path / "run")
    assert aged.probe is not None and aged.probe.source == "measured" and "days old" in aged.probe.why
    entry = read_entry(path)
    assert entry is not None and entry.measured_at > old
    assert [e["source"] for e in probe_events(aged.run_dir)] == ["cached", "measured", "measured", "measured"]


@pytest.mark.integration
def test_a_resumed_job_keeps_the_block_size_its_checkpoints_were_written_under(make_job, tmp_path, cache) -> None:
    """The block size decides which small optimizer sub-groups DeepSpeed swaps: a sweep that
    changed between an attempt and its resume must not move one out of its swap files."""
    job = nvme_job(make_job, tmp_path, "pinned")
    nvme = tmp_path / "pinned" / "nvme"
    hw = probe_basic(nvme)
    fp = fingerprint(nvme, hw)
    path = entry_path(ProbeCacheSettings(), fp)

    def seed(block: int) -> None:
        store_entry(path, ProbeEntry(fingerprint=fp, probe=AIO_PROBE_VERSION, measured_at=time.time(),
                                     probe_seconds=1.0, hardware=hw.model_copy(
            update={"aio": AioSettings(block_size=block, queue_depth=48, intra_op_parallelism=3)})))

    seed(1 << 20)
    first = prepare_local_run(job, run_dir=tmp_path / "run")
    assert aio_block(first) == (1 << 20, 48, 3)
    seed(8 << 20)  # the disk swept again: a larger block wins now
    assert aio_block(prepare_local_run(job, run_dir=tmp_path / "run")) == (8 << 20, 48, 3)  # no checkpoint yet
    first.write(tmp_path / "run" / "runtime.json")  # the attempt that wrote the checkpoints
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-00000002")
    resumed = prepare_local_run(job, run_dir=tmp_path / "run")
    assert aio_block(resumed) == (1 << 20, 48, 3)  # the queue depth and parallelism are today's
    assert resumed.probe is not None and "1024 KiB kept from the job's checkpoints" in resumed.probe.why


@pytest.mark.integration
def test_a_run_that_keeps_nothing_on_nvme_measures_nothing(make_job, tmp_path, cache) -> None:
    config = prepare_local_run(make_job("in-ram", offload={"policy": "none"}), run_dir=tmp_path / "run")
    assert config.probe is not None and config.probe.source == "unmeasured"
    assert not cache.exists() or not list(cache.glob("probe-*.json"))
    defaults = AioSettings()
    assert aio_block(config) == tuple(getattr(defaults, k) for k in AIO_KEYS)


@pytest.mark.integration
def test_the_first_run_measures_the_machines_compute_rates_and_the_plan_uses_them(make_job, tmp_path, cache,
                                                                                  monkeypatch, capsys) -> None:
    """Every plan needs them, NVMe or not: a job kept in RAM measures them too, once per machine."""
    monkeypatch.setenv("SPILLWAY_PROBE_COMPUTE", "1")
    monkeypatch.setenv("SPILLWAY_PROBE_COMPUTE_SECONDS", "0.3")
    first = prepare_local_run(make_job("in-ram", offload={"policy": "none"}), run_dir=tmp_path / "run1")
    [path] = cache.glob("compute-*.json")
    entry = ComputeEntry.model_validate_json(path.read_bytes())
    rates = entry.hardware.cpu_matmul
    assert {r.dtype for r in rates} == {"bf16", "fp32"}
    assert all(1e8 < r.flops_per_s < 1e14 for r in rates), rates  # 0.1 GFLOP/s .. 100 TFLOP/s
    adam = entry.hardware.cpu_adam_params_per_s
    assert adam is not None and 1e6 < adam < 1e12
    step, shape = first.plan.step, first.plan.model
    assert step.flops_source.startswith("measured: bf16 decoder layers at hidden size"), step.flops_source
    assert step.flops_per_s == matmul_rate_at(rates, "bf16", shape.hidden_size)
    assert step.compute == pytest.approx(step.flops / step.flops_per_s)
    # DeepSpeed's own engine ran both stages (`engine_probe`) and the host terms carry its ratio;
    # on a machine too busy to time it (the gate's other workers) it is refused, and said
    scale = entry.hardware.host_work_scale
    said = capsys.readouterr().out
    if scale is None:
        assert "DeepSpeed's host work not measured (ZeRO-3 over ZeRO-2" in said and step.host_work_scale == 1, said
    else:
        assert step.host_work_scale == scale, entry.hardware

    second = prepare_local_run(make_job("again", offload={"policy": "none"}), run_dir=tmp_path / "run2")
    assert ComputeEntry.model_validate_json(path.read_bytes()).measured_at == entry.measured_at  # not measured again
    assert second.plan.step.flops_per_s == step.flops_per_s
