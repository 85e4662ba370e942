"""The cached async-I/O sweep a local run plans with: what makes an entry stale, and what
of it is merged over the capacities measured fresh. No sweep runs here (the entries are
written by hand); tests/integration/test_probe_cache.py runs real ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from spillway_runtime.core.hardware import AioSettings, MatmulRate, NodeHardware
from spillway_runtime.core.planner import ModelShape, plan_tiers
from spillway_runtime.probe import probe_basic
from spillway_runtime.probe_cache import (
    AIO_PROBE_VERSION,
    DAY_SECONDS,
    ComputeEntry,
    ProbeCacheSettings,
    ProbeEntry,
    compute_entry_path,
    compute_fingerprint,
    entry_path,
    fingerprint,
    hardware_for_run,
    read_entry,
    staleness,
    store_entry,
    store_probe,
)

TUNED = AioSettings(block_size=8 << 20, queue_depth=128, intra_op_parallelism=2)


@pytest.fixture
def settings(tmp_path: Path) -> ProbeCacheSettings:
    return ProbeCacheSettings(cache_dir=tmp_path / "cache", sweep=True, compute=False)  # no measuring here


def measured(nvme: Path) -> NodeHardware:
    hw = probe_basic(nvme)
    return hw.model_copy(update={"aio": TUNED, "nvme_read_bytes_per_s": 3e9, "nvme_write_bytes_per_s": 2e9,
                                 "cpu_adam_params_per_s": 1.5e9, "nvme_free_bytes": 1})


def test_a_stored_probe_is_merged_over_fresh_capacities(tmp_path: Path, settings: ProbeCacheSettings) -> None:
    nvme = tmp_path / "nvme"
    path = store_probe(nvme, measured(nvme), settings)
    assert path is not None and path.parent == settings.directory
    # Another directory on the same disk reads the same entry: the sweep belongs to the disk.
    hw, record = hardware_for_run(tmp_path / "other-run" / "nvme", measure=False, settings=settings)
    assert record.source == "cached" and record.cache_file == str(path)
    assert hw.aio == TUNED and hw.nvme_read_bytes_per_s == 3e9 and hw.cpu_adam_params_per_s == 1.5e9
    assert hw.nvme_free_bytes > 1  # capacities are today's, not the cached ones
    assert hw.nvme_path == str((tmp_path / "other-run" / "nvme").resolve())
    assert "8192 KiB, queue depth 128, parallelism 2" in record.describe()
    assert "a transfer" not in record.describe()  # none measured


def test_the_disks_cost_per_transfer_is_kept_and_said(tmp_path: Path, settings: ProbeCacheSettings) -> None:
    nvme = tmp_path / "nvme"
    store_probe(nvme, measured(nvme).model_copy(update={"nvme_transfer_seconds": 0.0153}), settings)
    hw, record = hardware_for_run(nvme, measure=False, settings=settings)
    assert hw.nvme_transfer_seconds == 0.0153 and record.nvme_transfer_seconds == 0.0153
    assert "read 3.00 GB/s, write 2.00 GB/s, 15.3 ms a transfer" in record.describe()


def test_with_the_sweep_off_a_run_plans_with_the_defaults_beside_a_fresh_entry(
        tmp_path: Path, settings: ProbeCacheSettings) -> None:
    nvme = tmp_path / "nvme"
    store_probe(nvme, measured(nvme), settings)
    hw, record = hardware_for_run(nvme, measure=True, settings=settings.model_copy(update={"sweep": False}))
    assert record.source == "unmeasured" and "SPILLWAY_PROBE_SWEEP=0" in record.describe()
    assert hw.aio is None  # the plan takes DeepSpeed's defaults


def test_a_probe_without_async_io_is_not_stored(tmp_path: Path, settings: ProbeCacheSettings) -> None:
    assert store_probe(tmp_path, probe_basic(tmp_path), settings) is None
    assert not settings.directory.exists()


def test_an_entry_is_stale_when_old_when_the_machine_changed_or_when_asked(
        tmp_path: Path, settings: ProbeCacheSettings) -> None:
    hw = measured(tmp_path)
    fp = fingerprint(tmp_path, hw)
    entry = ProbeEntry(fingerprint=fp, probe=AIO_PROBE_VERSION, measured_at=time.time(), probe_seconds=3.0,
                       hardware=hw)
    assert staleness(entry, fp, settings) is None
    # swept before the sweep fitted the disk's cost per transfer: its rates were 64 MiB transfers'
    older = ProbeEntry.model_validate_json(json.dumps({k: v for k, v in json.loads(entry.model_dump_json()).items()
                                                       if k != "probe"}))
    assert "did not measure the disk's cost per transfer" in (staleness(older, fp, settings) or "")
    assert "no cached probe" in (staleness(None, fp, settings) or "")
    old = entry.model_copy(update={"measured_at": time.time() - 8 * DAY_SECONDS})
    assert "8.0 days old (max 7)" in (staleness(old, fp, settings) or "")
    assert staleness(old, fp, settings.model_copy(update={"max_age_days": 30})) is None
    moved = entry.model_copy(update={"fingerprint": fp.model_copy(update={"disk_model": "another disk",
                                                                          "gpu_count": fp.gpu_count + 1})})
    assert "(disk_model, gpu_count)" in (staleness(moved, fp, settings) or "")
    asked = settings.model_copy(update={"refresh": True})
    assert "re-probe was asked" in (staleness(entry, fp, asked) or "")


def test_a_stale_entry_is_not_used_and_nothing_is_measured_without_nvme(
        tmp_path: Path, settings: ProbeCacheSettings) -> None:
    hw = measured(tmp_path)
    fp = fingerprint(tmp_path, hw)
    path = entry_path(settings, fp)
    store_entry(path, ProbeEntry(fingerprint=fp.model_copy(update={"cpu_count": fp.cpu_count + 64}),
                                 probe=AIO_PROBE_VERSION, measured_at=time.time(), probe_seconds=3.0, hardware=hw))
    before = path.read_bytes()
    fresh, record = hardware_for_run(tmp_path, measure=False, settings=settings)
    assert record.source == "unmeasured" and "cpu_count" in record.why and "keeps nothing on NVMe" in record.why
    assert fresh.aio is None and fresh.nvme_read_bytes_per_s is None
    assert path.read_bytes() == before
    assert "not tuned to this disk" in record.describe()


def test_an_unreadable_entry_counts_as_none(tmp_path: Path, settings: ProbeCacheSettings) -> None:
    path = settings.directory / "probe-x.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"fingerprint": {"device": "8:1"}}))
    assert read_entry(path) is None
    assert read_entry(settings.directory / "absent.json") is None


def test_the_cache_lives_under_xdg_cache_home_unless_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPILLWAY_PROBE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ProbeCacheSettings().directory == tmp_path / "xdg" / "spillway"
    monkeypatch.setenv("SPILLWAY_PROBE_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("SPILLWAY_PROBE_MAX_AGE_DAYS", "1.5")
    monkeypatch.setenv("SPILLWAY_PROBE_REFRESH", "1")
    told = ProbeCacheSettings()
    assert (told.directory, told.max_age_days, told.refresh) == (tmp_path / "mine", 1.5, True)


def test_spillway_plan_of_a_job_plans_with_the_cached_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run plans as `spillway run` would: with the disk's cached aio settings (and never sweeps)."""
    import yaml
    from typer.testing import CliRunner

    from spillway_api.cli import build_app

    monkeypatch.setenv("SPILLWAY_PROBE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPILLWAY_PROBE_SWEEP", "1")
    monkeypatch.setenv("SPILLWAY_PROBE_COMPUTE", "0")  # no CPU matmuls or CPU Adam measured either
    nvme = tmp_path / "nvme"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "apiVersion": "spillway.dev/v1alpha1", "kind": "FineTuneJob", "metadata": {"name": "j"},
        "spec": {"model": {"uri": "model"}, "dataset": {"uri": "data.jsonl"},
                 "offload": {"optimizer": "nvme", "nvme": {"path": str(nvme)}}}}))
    untuned = CliRunner().invoke(build_app(), ["plan", str(job), "--params", "50M", "--output", "json"])
    assert untuned.exit_code == 0, untuned.output
    assert json.loads(untuned.output)["aio"] == AioSettings().model_dump()
    assert not list((tmp_path / "cache").glob("probe-*.json"))  # nothing was measured
    store_probe(nvme, measured(nvme))
    tuned = CliRunner().invoke(build_app(), ["plan", str(job), "--params", "50M", "--output", "json"])
    assert tuned.exit_code == 0, tuned.output
    assert json.loads(tuned.output)["aio"] == TUNED.model_dump()


RATES = [MatmulRate(dtype="bf16", hidden_size=256, flops_per_s=3e9), MatmulRate(dtype="fp32", hidden_size=256,
                                                                                 flops_per_s=9e10)]


def store_compute(settings: ProbeCacheSettings, basic: NodeHardware, **fingerprint_update: object) -> Path:
    fp = compute_fingerprint(basic).model_copy(update=fingerprint_update)
    path = compute_entry_path(settings, fp)
    measured = basic.model_copy(update={"cpu_matmul": RATES, "cpu_adam_params_per_s": 7e8})
    store_entry(path, ComputeEntry(fingerprint=fp, measured_at=time.time(), probe_seconds=1.0, hardware=measured))
    return path


def test_the_cached_compute_rates_reach_the_plan_whether_or_not_it_uses_nvme(tmp_path: Path,
                                                                             settings: ProbeCacheSettings) -> None:
    nvme = tmp_path / "nvme"
    settings = settings.model_copy(update={"compute": True})
    store_compute(settings, probe_basic(nvme))
    hw, record = hardware_for_run(nvme, measure=False, settings=settings)
    assert record.source == "unmeasured"  # no sweep of the disk: the plan keeps nothing on NVMe
    assert hw.cpu_matmul == RATES and hw.cpu_adam_params_per_s == 7e8
    shape = ModelShape.from_param_count(2_000_000)
    plan = plan_tiers(shape, hw.model_copy(update={"gpu_count": 0}))
    assert plan.step.flops_per_s == 3e9 and plan.step.flops_source.startswith("measured: bf16")
    # a disk entry's snapshot of other rates (its sweep's, under load) does not override them
    old = [MatmulRate(dtype="bf16", hidden_size=256, flops_per_s=4e8)]
    store_probe(nvme, measured(nvme).model_copy(update={"cpu_matmul": old}), settings)
    hw, record = hardware_for_run(nvme, measure=False, settings=settings)
    assert record.source == "cached" and hw.aio == TUNED and hw.nvme_read_bytes_per_s == 3e9
    assert hw.cpu_matmul == RATES and hw.cpu_adam_params_per_s == 7e8


def test_compute_rates_are_stale_when_torch_changed_or_asked_once_a_run_and_absent_when_off(
    tmp_path: Path, settings: ProbeCacheSettings
) -> None:
    from spillway_runtime.probe_cache import _compute_staleness, _read

    basic = probe_basic(tmp_path / "nvme")
    path = store_compute(settings, basic, torch="1.0.0")
    entry = _read(path, ComputeEntry)
    why = _compute_staleness(entry, compute_fingerprint(basic), settings)
    assert why is not None and "torch" in why
    # asked to re-probe: measured again, but once per process (a run plans twice)
    refresh = settings.model_copy(update={"refresh": True})
    assert entry is not None
    yesterday = entry.model_copy(update={"fingerprint": compute_fingerprint(basic),
                                         "measured_at": time.time() - DAY_SECONDS})
    assert _compute_staleness(yesterday, compute_fingerprint(basic), settings) is None
    assert _compute_staleness(yesterday, compute_fingerprint(basic), refresh) == "a re-probe was asked for"
    just_now = yesterday.model_copy(update={"measured_at": time.time()})
    assert _compute_staleness(just_now, compute_fingerprint(basic), refresh) is None
    hw, _ = hardware_for_run(tmp_path / "nvme", measure=False, settings=settings)  # compute=False
    assert hw.cpu_matmul == [] and hw.cpu_adam_params_per_s is None


def test_a_host_work_figure_not_measured_is_tried_again_alone_after_an_hour(
    tmp_path: Path, settings: ProbeCacheSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy machine's out-of-range reading leaves the entry without the figure: the next run
    after host_work_retry_hours measures it alone (the engine probe, faked here: its children are
    the integration tier's), keeps the other rates and their date, and records the try."""
    import spillway_runtime.engine_probe as engine_probe
    from spillway_runtime.probe_cache import _read, with_compute_rates

    readings = [None, 1.9]
    tries: list[int] = []

    def measure(cores: int) -> float | None:
        tries.append(cores)
        return readings[len(tries) - 1]

    monkeypatch.setattr(engine_probe, "measure_engine_host_work", measure)
    settings = settings.model_copy(update={"compute": True})
    basic = probe_basic(tmp_path / "nvme")
    path = store_compute(settings, basic)
    entry = _read(path, ComputeEntry)
    assert entry is not None and entry.hardware.host_work_scale is None
    measured_at = entry.measured_at
    assert with_compute_rates(basic, settings).host_work_scale is None and tries == []  # measured just now
    store_entry(path, entry.model_copy(update={"measured_at": measured_at - 2 * 3600}))
    assert with_compute_rates(basic, settings).host_work_scale is None and tries == [basic.cpu_cores]
    again = _read(path, ComputeEntry)
    assert again is not None and again.host_work_tried_at is not None and again.hardware.cpu_matmul == RATES
    assert with_compute_rates(basic, settings).host_work_scale is None and len(tries) == 1  # tried within the hour
    store_entry(path, again.model_copy(update={"host_work_tried_at": time.time() - 2 * 3600}))
    hw = with_compute_rates(basic, settings)
    assert hw.host_work_scale == 1.9 and hw.cpu_matmul == RATES and len(tries) == 2
    kept = _read(path, ComputeEntry)
    assert kept is not None and kept.measured_at == measured_at - 2 * 3600 and kept.hardware.host_work_scale == 1.9
    assert with_compute_rates(basic, settings).host_work_scale == 1.9 and len(tries) == 2  # a figure is kept


def test_the_sweeps_two_sizes_fit_the_disks_bandwidth_and_cost_per_transfer() -> None:
    """`probe.fit_transfer_cost`: times on the line cost + bytes / rate give the rate and the
    cost back (the cost the mean of the read's and the write's); a direction whose points make
    no such line (noise on a disk without the cost) keeps its rate at the larger size."""
    from spillway_runtime.probe import fit_transfer_cost

    small, large = 16 << 20, 64 << 20

    def rate(size: int, bandwidth: float, cost: float) -> float:
        return size / (cost + size / bandwidth)

    read_bps, write_bps, cost = fit_transfer_cost(
        small, (rate(small, 1.74e9, 0.015), rate(small, 2.83e9, 0.017)),
        large, (rate(large, 1.74e9, 0.015), rate(large, 2.83e9, 0.017)))
    assert (read_bps, write_bps, cost) == pytest.approx((1.74e9, 2.83e9, 0.016))
    # the small transfer a hair faster per byte than the large one: no cost, the large one's rate
    read_bps, write_bps, cost = fit_transfer_cost(small, (3.1e9, rate(small, 2.83e9, 0.002)),
                                                  large, (3.0e9, rate(large, 2.83e9, 0.002)))
    assert (read_bps, write_bps, cost) == pytest.approx((3.0e9, 2.83e9, 0.001))
