"""CPU: the process pool every multi-rank GPU test runs on
(vllm_petit_moe/testing/rank_pool.py): per-rank results and state, a failing rank's traceback,
a dead or silent rank failing the call instead of hanging the session, setup failures, and a
broken pool refusing further work."""
from __future__ import annotations

import os
import time

import pytest

from vllm_petit_moe.testing.rank_pool import RankPool, RankPoolError


def _setup(rank, world_size, tag):
    return {"rank": rank, "world_size": world_size, "tag": tag, "calls": 0}


def _setup_fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("setup broke on purpose")
    return {}


def _whoami(state, scale):
    state["calls"] += 1
    return state["tag"], state["rank"] * scale, state["world_size"], state["calls"]


def _fail_on_rank_1(state):
    if state["rank"] == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return "ok"


def _die_on_rank_0(state):
    if state["rank"] == 0:
        os._exit(3)
    return "ok"


def _sleep(state, seconds):
    time.sleep(seconds)
    return state["rank"]


@pytest.fixture
def pool():
    p = RankPool(2, _setup, ("t",), init_timeout_s=120)
    yield p
    p.close()


def test_runs_on_every_rank_and_keeps_its_state(pool):
    assert pool.run(_whoami, 10, timeout_s=60) == [("t", 0, 2, 1), ("t", 10, 2, 1)]
    assert pool.run(_whoami, 3, timeout_s=60) == [("t", 0, 2, 2), ("t", 3, 2, 2)]
    assert pool.healthy


def test_an_error_names_the_rank_and_breaks_the_pool(pool):
    with pytest.raises(RankPoolError, match=r"(?s)_fail_on_rank_1 failed.*--- rank 1 ---.*"
                                            r"rank 1 fails on purpose"):
        pool.run(_fail_on_rank_1, timeout_s=60)
    assert not pool.healthy
    with pytest.raises(RankPoolError, match="broken by an earlier failure"):
        pool.run(_whoami, 1)


def test_a_dead_rank_fails_the_call_instead_of_hanging(pool):
    start = time.monotonic()
    with pytest.raises(RankPoolError, match=r"ranks \[0\] died \(1 of 2 answered\)"):
        pool.run(_die_on_rank_0, timeout_s=300)
    assert time.monotonic() - start < 60  # found dead within a poll, not at the timeout


def test_a_silent_rank_fails_the_call_at_the_timeout(pool):
    with pytest.raises(RankPoolError, match=r"_sleep: no answer within 2 s \(0 of 2"):
        pool.run(_sleep, 6, timeout_s=2)
    assert not pool.healthy


def test_a_setup_failure_is_reported_with_its_traceback():
    with pytest.raises(RankPoolError, match=r"(?s)setup failed.*--- rank 1 ---\nsetup: .*"
                                            r"setup broke on purpose"):
        RankPool(2, _setup_fails_on_rank_1, init_timeout_s=120, what="setup")
