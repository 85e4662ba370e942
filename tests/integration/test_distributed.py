"""A two-node job, two supervisors rendezvousing as pods do (gloo on the CPU), stops both nodes
on one SIGTERM. (Two processes under one supervisor, each checkpointing its own shard and
swap files and resuming bit-identically: tests/integration/test_exact_resume.py.)"""

import pytest

from spillway_runtime.training.reporting import read_events


@pytest.mark.integration
def test_two_nodes_rendezvous_and_a_stop_on_one_node_stops_both_with_75(tmp_path, make_job):
    """Two supervisors with one rank each, as the pods of a two-node job run them (here on one
    machine, sharing the checkpoint directory as an RWX volume). A SIGTERM to one node's pod
    stops both ranks at the same step with one checkpoint, and both pods exit 75."""
    import signal
    import subprocess
    import sys

    from spillway_runtime.checkpoints.store import CheckpointStore, checkpoint_name
    from spillway_runtime.local import prepare_local_run, runtime_env
    from spillway_runtime.training.processes import free_port
    from tests import polling

    job = make_job(training={"maxSteps": 200}, checkpoint={"everySteps": 1000},
                   offload={"optimizer": "cpu", "parameters": "cpu"})
    run_dir = tmp_path / "run"
    config = prepare_local_run(job, run_dir=run_dir, processes=2)
    port, env = free_port(), runtime_env(config)
    env["OMP_NUM_THREADS"] = "1"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "spillway_runtime.training.supervisor", "--processes=1", f"--config={run_dir / 'runtime.json'}",
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
