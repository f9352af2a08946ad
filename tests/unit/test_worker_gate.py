"""A worker host's gate: ready while its head answers, fail closed when the head never comes,
and stop the worker when the head goes (vLLM's headless worker would idle on)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import ReadinessError
from core.profiles import load_profile
from entrypoint.resolve import resolve
from entrypoint.worker_gate import WorkerGate
from tests.support.plans import PAIR_HEAD, PAIR_WORKER, user_settings


@pytest.fixture
def engine():
    """A process standing in for the engine the gate watches (its pid and start time)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def gate(answers, ready_timeout: float = 30.0, **values) -> WorkerGate:
    profile = load_profile("spark-pair")
    settings = user_settings("spark-pair", models_dir=Path("/models"), **{**PAIR_WORKER, **values})
    resolved = resolve(profile, settings)
    # model_copy skips validation: a READY_TIMEOUT shorter than the knob allows, for the test
    return WorkerGate(profile, settings.model_copy(update={"ready_timeout": ready_timeout}), resolved,
                      identity="id", answers=answers, poll_s=0.01, lost_after_s=0.05)


def test_the_gate_records_ready_with_the_head_and_stops_the_worker_when_the_head_goes(engine):
    replies = iter([False, False, True, True, True] + [False] * 1000)
    asked, reports, stops = [], [], []

    def answers(address, port):
        asked.append((address, port))
        return next(replies)

    def stop(reason, workers_wedged=False):
        stops.append((reason, workers_wedged))

    code = gate(answers).run(engine.pid, stop=stop, publish=reports.append)
    assert code == 1 and asked[0] == ("192.168.100.10", 29501)
    first, last = reports
    assert first.ready and first.head == "192.168.100.10:29501" and first.identity == "id"
    assert first.checks == ["head 192.168.100.10:29501 answers (torch.distributed rendezvous of node rank 0)"]
    assert not last.ready and last.error == "the head 192.168.100.10:29501 stopped answering for 0 s"
    assert stops == [(last.error, True)]  # its TP workers wait on the departed head: killed at once


def test_a_head_that_never_answers_fails_the_worker_closed(engine):
    reports, stops = [], []
    code = gate(lambda address, port: False, ready_timeout=0.1).run(engine.pid, stop=stops.append,
                                                                    publish=reports.append)
    (report,) = reports
    assert code == 1 and not report.ready
    assert report.error == "the head 192.168.100.10:29501 did not answer within 0 s (READY_TIMEOUT)"
    assert stops == [report.error]


def test_an_engine_that_exits_while_waiting_ends_the_gate_without_a_stop(engine):
    engine.kill()
    engine.wait()
    stops = []
    assert gate(lambda address, port: False).run(engine.pid, stop=stops.append, publish=lambda r: None) == 1
    assert stops == []


def test_only_a_worker_host_has_a_worker_gate():
    profile = load_profile("spark-pair")
    head = resolve(profile, user_settings("spark-pair", **PAIR_HEAD))
    with pytest.raises(ReadinessError, match="this host is not a worker of a multi-host profile"):
        WorkerGate(profile, user_settings("spark-pair", **PAIR_HEAD), head)
