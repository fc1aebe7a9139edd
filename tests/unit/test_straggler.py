"""Straggler scores on synthetic step times: named when slow, never when the whole job is."""

from __future__ import annotations

import random

import pytest

from nvrx.straggler import StepScores, StragglerRule

RANKS = 4


def _run(steps: int, slowdown, seed: int = 0, noise: float = 0.15, scores: StepScores | None = None, ranks: int = RANKS):
    """Feed ``steps`` steps of every rank (1 s times a lognormal noise times
    ``slowdown(rank, step)``), evaluating ranks at every step; the changes with their step."""
    rng = random.Random(seed)
    scores = scores or StepScores()
    changes = []
    for step in range(steps):
        for rank in range(ranks):
            scores.record(rank, rng.lognormvariate(0, noise) * slowdown(rank, step))
        changes += [(step, c) for c in scores.evaluate(scores.scores())]
    return changes, scores


@pytest.mark.parametrize("ranks", [2, RANKS])
@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_job_names_no_one(seed, ranks):
    changes, _ = _run(3000, lambda rank, step: 1.0, seed=seed, ranks=ranks)
    assert changes == []


def test_the_whole_job_slowing_down_names_no_one():
    changes, _ = _run(600, lambda rank, step: 2.0 if 200 <= step < 400 else 1.0)
    assert changes == []


def test_one_outlier_step_names_no_one():
    changes, _ = _run(300, lambda rank, step: 10.0 if (rank, step) == (3, 100) else 1.0)
    assert changes == []


def test_a_rank_30_percent_slower_from_step_50_is_named_within_the_bound_then_cleared():
    rule = StragglerRule()
    # 5 % noise per step: a 30 % slowdown is clear of it (at 15 %, as above, it is not always)
    slow = lambda rank, step: 1.3 if rank == 3 and 50 <= step < 150 else 1.0  # noqa: E731
    changes, scores = _run(300, slow, noise=0.05)
    assert [(c.who, c.state) for _, c in changes] == [(3, "slow"), (3, "recovered")]
    named, cleared = changes[0][0], changes[1][0]
    assert 50 <= named <= 50 + rule.detection_bound
    assert 150 <= cleared <= 150 + rule.detection_bound
    assert changes[0][1].score < rule.threshold and scores.slow() == set()


def test_of_two_ranks_the_one_30_percent_slower_is_named():
    """The reference of two medians is the faster one's (their lower quartile, a quarter of
    the way to the slower, named a rank only from about 36 % slower at the default 0.8)."""
    slow = lambda rank, step: 1.3 if rank == 1 and step >= 50 else 1.0  # noqa: E731
    changes, _ = _run(200, slow, noise=0.05, ranks=2)
    assert [(c.who, c.state) for _, c in changes] == [(1, "slow")]
    assert changes[0][0] <= 50 + StragglerRule().detection_bound


def test_a_slow_node_is_named_by_its_ranks_median():
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    scores = StepScores()
    rng = random.Random(1)
    named = []
    for step in range(200):
        for rank in range(RANKS):
            scores.record(rank, rng.lognormvariate(0, 0.05) * (1.3 if node_of[rank] == 1 and step >= 50 else 1.0))
        named += [(step, c.who) for c in scores.evaluate(scores.node_scores(node_of), of="node")]
    assert [who for _, who in named] == [1] and named[0][0] <= 50 + StragglerRule().detection_bound
    assert scores.slow("node") == {1} and scores.slow("rank") == set()  # ranks were not judged


def test_bad_settings_and_times_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="window must be an int ≥ 3, got 1"):
        StragglerRule(window=1)
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\), got 1.5"):
        StragglerRule(threshold=1.5)
    with pytest.raises(ValueError, match="confirm must be an int ≥ 1, got 0"):
        StragglerRule(confirm=0)
    with pytest.raises(ValueError, match=r"clear_at must be in \[threshold, 1\] = \[0.8, 1\], got 0.7"):
        StragglerRule(clear_at=0.7)
    with pytest.raises(ValueError, match="seconds must be ≥ 0, got -1"):
        StepScores().record(0, -1)
    with pytest.raises(ValueError, match="of must be 'rank' or 'node', got 'host'"):
        StepScores().evaluate({}, of="host")
