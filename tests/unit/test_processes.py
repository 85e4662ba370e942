"""The stop/abort contract between a launcher and its training processes, as pure rules."""

import signal

import pytest

from spillway_runtime.core.contract import ExitCode
from spillway_runtime.training.processes import StopSignals, exit_status
from spillway_runtime.training.supervisor import combined_exit


@pytest.mark.parametrize(("returncode", "stop_sent", "status"), [
    (0, False, 0),
    (75, True, 75),
    (2, True, 2),
    (-signal.SIGTERM, True, 75),    # stopped before its handler existed: nothing was lost
    (-signal.SIGTERM, False, 143),  # a SIGTERM we did not send is a death, as a shell reports it
    (-signal.SIGKILL, True, 137),
])
def test_exit_status(returncode, stop_sent, status):
    assert exit_status(returncode, stop_sent) == status


@pytest.mark.parametrize(("codes", "combined"), [
    ([0, 0], 0),
    ([75, 75], 75),
    ([0, 75], 75),      # one rank finished its last step as the other stopped: restartable
    ([75, 137], 137),   # a rank that died is the run's outcome
    ([4, 75], 4),
    ([2, 2], 2),
])
def test_combined_exit(codes, combined):
    assert combined_exit(codes) == combined


class Target:
    def __init__(self):
        self.calls = []

    def stop(self):
        self.calls.append("stop")

    def abort(self):
        self.calls.append("abort")


@pytest.mark.parametrize(("signals", "calls"), [
    ([signal.SIGTERM], ["stop"]),
    ([signal.SIGTERM, signal.SIGTERM, signal.SIGTERM], ["stop"]),
    ([signal.SIGINT], ["stop"]),
    ([signal.SIGINT, signal.SIGINT], ["stop", "abort"]),
    ([signal.SIGTERM, signal.SIGINT], ["stop", "abort"]),
    ([signal.SIGINT, signal.SIGTERM], ["stop"]),
])
def test_first_signal_stops_a_second_ctrl_c_aborts(signals, calls):
    target, said = Target(), []
    handler = StopSignals(target, say=said.append)
    for sig in signals:
        handler(sig, None)
    assert target.calls == calls
    assert len(said) == len(calls)


def test_handlers_are_installed_and_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals(Target()) as handler:
        assert signal.getsignal(signal.SIGTERM) is handler and signal.getsignal(signal.SIGINT) is handler
    assert signal.getsignal(signal.SIGTERM) is before
    assert ExitCode.ABORTED == 130
