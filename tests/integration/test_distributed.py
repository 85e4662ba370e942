"""Two training processes under our supervisor (gloo on the CPU), ZeRO-3 with the optimizer on
NVMe: each rank checkpoints its own shard and swap files, and a resume after SIGKILL of
the whole process group reproduces the uninterrupted run; and a two-node job, two supervisors
rendezvousing as pods do, stops both nodes on one SIGTERM."""

import pytest

from spillway_runtime.reporting import read_events
from spillway_runtime.runconfig import FaultInjection

from .conftest import run_job


@pytest.mark.integration
def test_two_processes_zero3_nvme_checkpoint_per_rank_and_resume(tmp_path, make_job):
    offload = {"optimizer": "nvme", "parameters": "cpu", "nvme": {"path": str(tmp_path / "nvme")}}
    job = make_job(training={"maxSteps": 8}, offload=offload)

    reference = run_job(job, tmp_path / "reference", processes=2)
    assert reference.returncode == 0, reference.log[-4000:]
    assert reference.of("started")[0]["world_size"] == 2
    ckpt = tmp_path / "reference" / "checkpoints" / "step-00000006"
    for rank in (0, 1):
        assert (ckpt / f"rank{rank}-spillway_state.pt").is_file()
        assert list((ckpt / "ds" / "offloaded_tensors" / f"rank{rank:02d}").glob("exp_avg-*.tensor.swp"))
        assert list((ckpt / "ds").glob(f"*zero_pp_rank_{rank}_*optim_states.pt"))

    killed = run_job(job, tmp_path / "run", processes=2, faults=FaultInjection(step_sleep_seconds=0.5),
                     signal_at_step=5)
    assert killed.returncode != 0
    resumed = run_job(job, tmp_path / "run", processes=2)
    assert resumed.returncode == 0, resumed.log[-4000:]
    start = resumed.of("resumed")[-1]["step"]
    assert start == 3
    expected, got = reference.losses(), resumed.losses()
    mismatches = {s: (got[s], expected[s]) for s in range(start + 1, 9) if got[s] != expected[s]}
    assert not mismatches, f"losses differ from the uninterrupted run (raw floats) at {mismatches}"


@pytest.mark.integration
def test_two_nodes_rendezvous_and_a_stop_on_one_node_stops_both_with_75(tmp_path, make_job):
    """Two supervisors with one rank each, as the pods of a two-node job run them (here on one
    machine, sharing the checkpoint directory as an RWX volume). A SIGTERM to one node's pod
    stops both ranks at the same step with one checkpoint, and both pods exit 75."""
    import signal
    import subprocess
    import sys

    from spillway_runtime.checkpoint import CheckpointStore, checkpoint_name
    from spillway_runtime.local import prepare_local_run, runtime_env
    from spillway_runtime.processes import free_port
    from tests import polling

    job = make_job(training={"maxSteps": 200}, checkpoint={"everySteps": 1000},
                   offload={"optimizer": "cpu", "parameters": "cpu"})
    run_dir = tmp_path / "run"
    config = prepare_local_run(job, run_dir=run_dir, processes=2)
    port, env = free_port(), runtime_env(config)
    env["OMP_NUM_THREADS"] = "1"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "spillway_runtime.supervisor", "--processes=1", f"--config={run_dir / 'runtime.json'}",
         "--nnodes=2", f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}"],
        env=env, stdout=(tmp_path / f"node{rank}.log").open("w"), stderr=subprocess.STDOUT) for rank in (0, 1)]
    try:
        events = run_dir / "events.jsonl"
        polling.wait_for(lambda: '"step": 3,' in (events.read_text() if events.exists() else ""), 300, "step 3")
        nodes[1].send_signal(signal.SIGTERM)  # only the second node's pod is told to stop
        codes = [node.wait(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    logs = "".join((tmp_path / f"node{rank}.log").read_text()[-2000:] for rank in (0, 1))
    assert codes == [75, 75], logs
    started = [e for e in read_events(events) if e["event"] == "started"]
    assert started[0]["world_size"] == 2
    [preempted] = [e for e in read_events(events) if e["event"] == "preempted"]
    info = CheckpointStore(run_dir / "checkpoints", keep=3).find_good()
    assert info is not None and info.name == checkpoint_name(preempted["step"])
    assert {p.name for p in info.path.glob("rank*-spillway_state.pt")} == {
        "rank0-spillway_state.pt", "rank1-spillway_state.pt"}
