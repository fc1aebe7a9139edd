"""Straggler scores: which ranks (and nodes) run their steps slower than the job's others.

Each rank's step times (its own work, not the time it waits for others in collectives:
in synchronous training every rank's wall-clock step is the slowest one's) are kept in a
sliding window of the last ``window`` steps. A rank's *score* is the job's reference time
divided by the rank's own window median, capped at 1; the reference is the lower quartile
of the ranks' window medians, the faster one's of two (the job's fast ranks: half the job
turning slow does not move it, where the median would). 1 for a rank as fast as the
reference, 0.77 for one 30 % slower. Medians make a score indifferent to one outlier step
(a checkpoint, a page fault); the ratio makes it indifferent to the whole job slowing down
(an evaluation, a shared file system). NVRx's relative score divides by the fastest rank
instead.

A rank is *named* a straggler when its score stays below ``threshold`` for ``confirm``
consecutive evaluations, and *cleared* when it stays at or above ``clear_at`` (higher:
a rank slowed just past the threshold does not flap between the two) as long. A rank that
turns slow at step ``s`` has a window of slow steps only from ``s + window``: evaluated
at every step, it is named by ``s + rule.detection_bound`` when its slowdown is clear of
the noise. A node is scored the same way among the nodes, by the median of its ranks'
medians (a job of one node has no node scores), and named and cleared by the same rule.

A job's scorer need not hold every rank's steps: ``scores_of`` scores the window medians
that each node computes for its own ranks, and ``evaluate`` counts a verdict's streak in
steps (``steps``: how many steps the job made since the last evaluation), so that an
evaluation every few steps names a rank after as many steps as one at every step would.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StragglerRule:
    """When a rank counts as slow. ``threshold`` is a score (0..1): 0.8 names a rank 25 %
    slower than the job's fast ranks; NVRx's default, 0.75, only one 33 % slower."""

    window: int = 20
    threshold: float = 0.8
    confirm: int = 6
    clear_at: float = 0.9
    looks: int = 3  # evaluations the verdict must hold through too, however many steps each

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 3:
            raise ValueError(f"StragglerRule: window must be an int ≥ 3, got {self.window!r}")
        if not 0 < self.threshold < 1:
            raise ValueError(f"StragglerRule: threshold must be in (0, 1), got {self.threshold!r}")
        if not isinstance(self.confirm, int) or self.confirm < 1:
            raise ValueError(f"StragglerRule: confirm must be an int ≥ 1, got {self.confirm!r}")
        if not isinstance(self.looks, int) or self.looks < 1:
            raise ValueError(f"StragglerRule: looks must be an int ≥ 1, got {self.looks!r}")
        if not self.threshold <= self.clear_at <= 1:
            raise ValueError(
                f"StragglerRule: clear_at must be in [threshold, 1] = [{self.threshold}, 1], got {self.clear_at!r}"
            )

    @property
    def detection_bound(self) -> int:
        """Steps from a rank turning clearly slow to its naming, evaluated at every step."""
        return self.window + self.confirm


@dataclass(frozen=True)
class Change:
    """A rank or node named a straggler (``slow``) or cleared (``recovered``)."""

    of: str  # "rank" | "node"
    who: Hashable
    state: str  # "slow" | "recovered"
    score: float


@dataclass
class _Verdict:
    slow: bool = False
    streak: int = 0  # steps of the consecutive evaluations that disagree with ``slow``
    looks: int = 0  # how many such evaluations

    def judge(self, score: float, rule: StragglerRule, steps: int = 1) -> bool:
        """Count one evaluation, ``steps`` steps after the last; True when the verdict flips:
        it disagreed for ``rule.confirm`` steps and at least ``rule.looks`` evaluations."""
        slow_now = score < (rule.clear_at if self.slow else rule.threshold)
        if slow_now == self.slow:
            self.streak = self.looks = 0
            return False
        self.streak, self.looks = self.streak + steps, self.looks + 1
        if self.streak < rule.confirm or self.looks < rule.looks:
            return False
        self.slow, self.streak, self.looks = slow_now, 0, 0
        return True


@dataclass
class StepScores:
    """Step times per rank, their scores, and the stragglers they name (see the module)."""

    rule: StragglerRule = field(default_factory=StragglerRule)
    _times: dict[Hashable, deque[float]] = field(default_factory=dict)
    _verdicts: dict[tuple[str, Hashable], _Verdict] = field(default_factory=dict)

    def record(self, rank: Hashable, seconds: float) -> None:
        """One step of ``rank`` took ``seconds`` of its own work."""
        if not seconds >= 0:
            raise ValueError(f"StepScores.record: seconds must be ≥ 0, got {seconds!r}")
        self._times.setdefault(rank, deque(maxlen=self.rule.window)).append(float(seconds))

    def forget(self, rank: Hashable) -> None:
        """Drop ``rank``'s window: its process was started anew, its first steps warm up."""
        self._times.pop(rank, None)

    def medians(self) -> dict[Hashable, float]:
        """Each rank's median step time over its window, for the ranks whose window is full."""
        full = {rank: t for rank, t in self._times.items() if len(t) == self.rule.window}
        return {rank: statistics.median(times) for rank, times in full.items()}

    def scores(self) -> dict[Hashable, float]:
        """Each rank's score, once every rank has a full window (empty before)."""
        medians = self.medians()
        return scores_of(medians) if len(medians) == len(self._times) else {}

    def node_scores(self, node_of: Mapping[Hashable, Hashable]) -> dict[Hashable, float]:
        """Each node's score (``node_scores_of``; ``node_of`` maps rank to node), once every
        rank has a full window (empty before)."""
        medians = self.medians()
        return node_scores_of(medians, node_of) if len(medians) == len(self._times) else {}

    def evaluate(
        self, scores: Mapping[Hashable, float], of: str = "rank", steps: int = 1
    ) -> list[Change]:
        """Judge ``scores`` of ranks (``scores()``) or of nodes (``node_scores()``, with
        ``of="node"``) once, ``steps`` steps after the last evaluation; what changed."""
        if of not in ("rank", "node"):
            raise ValueError(f"StepScores.evaluate: of must be 'rank' or 'node', got {of!r}")
        changes = []
        for who, score in scores.items():
            verdict = self._verdicts.setdefault((of, who), _Verdict())
            if verdict.judge(score, self.rule, steps):
                changes.append(Change(of, who, "slow" if verdict.slow else "recovered", score))
        return changes

    def reset(self, of: str, who: Hashable) -> None:
        """Judge ``who`` afresh, as if never judged: it is not the rank it was (it moved to
        another node), and neither its verdict nor a streak towards one holds for it there."""
        self._verdicts.pop((of, who), None)

    def take_back(self, change: Change) -> None:
        """Undo ``change``, which could not be told: its verdict stays as it was, and the next
        evaluation that still disagrees with it makes the change again."""
        verdict = self._verdicts[(change.of, change.who)]
        verdict.slow = change.state != "slow"
        verdict.streak, verdict.looks = self.rule.confirm, self.rule.looks - 1

    def slow(self, of: str = "rank") -> set[Hashable]:
        """The ranks (or nodes) named stragglers now."""
        return {who for (kind, who), verdict in self._verdicts.items() if kind == of and verdict.slow}


def reference_of(medians: Mapping[Hashable, float]) -> float:
    """The job's reference step time: the lower quartile of the ranks' medians (two or more);
    of two, the faster one's (a quartile between them moves with the slower one)."""
    if len(medians) == 2:
        return min(medians.values())
    return statistics.quantiles(medians.values(), n=4, method="inclusive")[0]


def scores_of(medians: Mapping[Hashable, float]) -> dict[Hashable, float]:
    """Each rank's score from the window medians of every rank (empty for fewer than two);
    ranks whose median is 0 (no work timed) are not scored and set no reference."""
    medians = {rank: m for rank, m in medians.items() if m > 0}
    if len(medians) < 2:
        return {}
    reference = reference_of(medians)
    return {rank: min(1.0, reference / m) for rank, m in medians.items()}


def node_medians_of(
    medians: Mapping[Hashable, float], node_of: Mapping[Hashable, Hashable]
) -> dict[Hashable, float]:
    """Each node's median step time: the median of its ranks' window medians (those not 0)."""
    by_node: dict[Hashable, list[float]] = {}
    for rank, median in medians.items():
        if median > 0:
            by_node.setdefault(node_of[rank], []).append(median)
    return {node: statistics.median(values) for node, values in by_node.items()}


def node_scores_of(
    medians: Mapping[Hashable, float], node_of: Mapping[Hashable, Hashable]
) -> dict[Hashable, float]:
    """Each node's score among the nodes (empty for fewer than two): its median step time
    (``node_medians_of``), scored as a rank's median is (``scores_of``). Nodes are judged
    against nodes, not against the ranks' reference: a rank that does more than the others
    on every node (the one that logs, say) weighs alike on each and makes no node slow."""
    return scores_of(node_medians_of(medians, node_of))


__all__ = [
    "Change", "StepScores", "StragglerRule", "node_medians_of", "node_scores_of", "reference_of",
    "scores_of",
]  # fmt: skip
