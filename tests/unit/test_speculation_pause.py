"""The pay-or-pause policy: each arm measured, the faster kept, the slower retried now and then."""

from __future__ import annotations

from tokenmill.worker.speculation_pause import PayOrPause


def run_windows(policy: PayOrPause, rate: dict[bool, float], windows: int) -> list[bool]:
    """Feed ``windows`` windows of steps at the given tokens/s per arm; the arm of each."""
    arms = []
    for _ in range(windows):
        arm = policy.drafting
        arms.append(arm)
        for _ in range(policy.window):
            policy.record(10, 10 / rate[arm])
    return arms


def test_speculation_that_does_not_pay_is_paused_and_retried_now_and_then():
    policy = PayOrPause(window=4, explore_every=5)
    arms = run_windows(policy, {True: 60.0, False: 80.0}, 30)
    assert arms[:2] == [True, False]  # both measured first
    assert arms.count(True) <= 2 + 30 // 5 and arms.count(False) >= 20
    assert any(arms[10:])  # and drafting is tried again later
    later = run_windows(policy, {True: 60.0, False: 80.0}, 200)
    assert 1 <= later.count(True) <= 6  # ever less often while it keeps losing (every 64 windows at most)


def test_speculation_that_pays_stays_on_and_a_change_of_workload_is_followed():
    policy = PayOrPause(window=4, explore_every=5)
    arms = run_windows(policy, {True: 150.0, False: 80.0}, 20)
    assert arms[2:].count(True) >= 14
    arms = run_windows(policy, {True: 50.0, False: 80.0}, 20)  # the text stopped repeating its prompt
    assert arms[-10:].count(False) >= 7
