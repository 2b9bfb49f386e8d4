"""Which rank the launcher names when a run fails (rltrain.launch.local.first_failure)."""

from __future__ import annotations

from rltrain.launch.local import first_failure
from rltrain.runtime.errors import clear_reports, lost_peer_ranks, report_lost_peer, report_user_error


def test_no_failure_while_ranks_run_or_succeed(tmp_path):
    assert first_failure({0: None, 1: 0}, tmp_path) is None


def test_a_rank_killed_by_a_signal_is_the_cause_not_its_victims(tmp_path):
    failure = first_failure({0: 1, 1: -9, 2: None}, tmp_path)
    assert failure is not None and failure.rank == 1 and not failure.user_error
    assert failure.message == "rltrain: rank 1 exited with code -9 (killed by SIGKILL); stopping the other ranks"


def test_the_lowest_failed_rank_without_a_signal(tmp_path):
    failure = first_failure({0: None, 1: 3, 2: 1}, tmp_path)
    assert failure is not None and failure.rank == 1 and "exited with code 3" in failure.message


def test_a_recorded_user_error_names_its_rank_even_if_a_peer_exited_first(tmp_path):
    report_user_error(tmp_path, 1, "reward function 'x:y' raised ValueError: bad")
    failure = first_failure({0: 1, 1: None}, tmp_path)
    assert failure is not None and failure.rank == 1 and failure.user_error
    assert failure.message == "rltrain: error: rank 1: reward function 'x:y' raised ValueError: bad"


def test_a_rank_whose_collective_failed_is_not_named_when_the_peer_it_lost_failed_too(tmp_path):
    """Both exits land in one poll: the rank that failed by itself is named, whatever its number."""
    report_lost_peer(tmp_path, 0)
    failure = first_failure({0: 1, 1: 1, 2: None}, tmp_path)
    assert failure is not None and failure.rank == 1
    assert failure.message == "rltrain: rank 1 exited with code 1; stopping the other ranks"


def test_while_only_ranks_that_lost_a_peer_failed_the_launcher_can_wait_for_the_cause(tmp_path):
    report_lost_peer(tmp_path, 0)
    assert first_failure({0: 1, 1: None}, tmp_path, wait_for_cause=True) is None
    late = first_failure({0: 1, 1: 1}, tmp_path, wait_for_cause=True)  # the cause has left: no wait
    assert late is not None and late.rank == 1
    gave_up = first_failure({0: 1, 1: None}, tmp_path)  # waited long enough: the rank that failed
    assert gave_up is not None and gave_up.rank == 0


def test_lost_peer_records_are_forgotten_with_the_reports_of_an_earlier_attempt(tmp_path):
    report_lost_peer(tmp_path, 1)
    report_lost_peer(tmp_path, 3)
    assert lost_peer_ranks(tmp_path) == {1, 3}
    clear_reports(tmp_path)
    assert lost_peer_ranks(tmp_path) == set()
    failure = first_failure({0: 1, 1: 1}, tmp_path)
    assert failure is not None and failure.rank == 0


def test_the_agent_gets_a_shutdown_timeout_only_where_torch_takes_one(monkeypatch):
    """torch 2.13's agent takes `shutdown_timeout`; 2.11's (the GPU machine's image) refused it with a
    TypeError and no rank started."""
    from rltrain.launch import local

    assert local.shutdown_timeout_kwargs() == {"shutdown_timeout": local.SHUTDOWN_TIMEOUT_S}

    class OlderAgent:
        def __init__(self, spec, logs_specs, start_method="spawn", exit_barrier_timeout=300.0):
            pass

    monkeypatch.setattr(local, "LocalElasticAgent", OlderAgent)
    assert local.shutdown_timeout_kwargs() == {}
