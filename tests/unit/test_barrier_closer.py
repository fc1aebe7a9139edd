"""The closing of a barrier met by its keys (``nvrx.store.barrier``) when the arrival that
took it ended before it released: an arrival of the same host takes it over; one whose
closer still runs, or cannot be told ended from here, does not."""

from __future__ import annotations

import subprocess

import pytest

from nvrx import processes
from nvrx.store import barrier
from nvrx.store.seal import Sealer, new_secret

pytestmark = pytest.mark.timeout(60)

SEALINGS = {"unsealed": None, "sealed": barrier.Sealing(Sealer(bytes.fromhex(new_secret()), 0))}


def _store():
    from torch.distributed import HashStore

    return HashStore()


@pytest.fixture(scope="module")
def ended() -> str:
    """The identity of a process that ended (a closer killed while it closed)."""
    child = subprocess.Popen(["sleep", "60"])
    name = processes.identity(child.pid)
    child.kill()
    child.wait()
    assert name is not None and processes.gone(name)
    return name


class _Killed(Exception):
    """The closer's end, inside its ``before_release``."""


def _closed_by(store, name: str, closer: str, sealing, opened: list[str]) -> None:
    """Ranks 0 and 1 arrive as one group whose arrival completes barrier ``name`` and takes
    its closing as ``closer``, and ends inside ``before_release``: nothing released."""

    def killed() -> None:
        opened.append("closer")
        raise _Killed

    with pytest.raises(_Killed):
        barrier.arrive_group(store, name, [0, 1], 2, before_release=killed, sealing=sealing,
                             closer=closer)  # fmt: skip
    assert not barrier.raised(store, barrier.release_key(name), sealing)


def _rank_arrives(store, name: str, sealing, opened: list[str], who: str = "rank") -> bool:
    """Rank 0 arrives itself (its agent is gone): whether it closed the barrier."""
    return barrier.arrive(store, name, 0, 2, reentrant=True, by_keys=True, sealing=sealing,
                          before_release=lambda: opened.append(who))  # fmt: skip


@pytest.mark.parametrize("sealing", SEALINGS.values(), ids=SEALINGS.keys())
def test_a_closing_held_by_a_process_that_ended_is_taken_over_once(ended, sealing) -> None:
    store, opened = _store(), []
    _closed_by(store, "b", f"t@{ended}", sealing, opened)
    assert _rank_arrives(store, "b", sealing, opened)
    assert opened == ["closer", "rank"]  # before_release again, as a try again runs it
    assert barrier.raised(store, barrier.release_key("b"), sealing)
    # the closing is the rank's now, and it runs: the next arrival closes nothing
    assert not _rank_arrives(store, "b", sealing, opened, who="another")
    assert opened == ["closer", "rank"]


@pytest.mark.parametrize("sealing", SEALINGS.values(), ids=SEALINGS.keys())
def test_a_closing_held_by_a_process_that_runs_or_cannot_be_told_is_left_to_it(
    ended, sealing
) -> None:
    """Held by this process (a closer that is only slow), by one of another boot (another
    host's), or with a token that names no process: the rank waits for that closer's
    release (or the barrier's timeout), as before."""
    boot, rest = ended.split("/", 1)
    for n, closer in enumerate([barrier.closer_token(), f"t@other-{boot}/{rest}", "t"]):
        store, opened = _store(), []
        _closed_by(store, f"b{n}", closer, sealing, opened)
        assert not _rank_arrives(store, f"b{n}", sealing, opened), closer
        assert opened == ["closer"] and not barrier.is_released(store, f"b{n}", sealing)


@pytest.mark.parametrize("sealing", SEALINGS.values(), ids=SEALINGS.keys())
def test_a_closer_that_ended_after_its_release_is_not_taken_over(ended, sealing, caplog) -> None:
    store, opened = _store(), []
    assert barrier.arrive_group(store, "b", [0, 1], 2, before_release=lambda: opened.append("closer"),
                                sealing=sealing, closer=f"t@{ended}")  # fmt: skip
    assert not _rank_arrives(store, "b", sealing, opened)  # released already: not by it
    assert opened == ["closer"] and "this one closes it" not in caplog.text
    assert barrier.raised(store, barrier.release_key("b"), sealing)


class _RacedAtTakeOver:
    """A store on which, when an arrival is about to take the closing over, another arrival
    comes first and does the same."""

    def __init__(self, store, other) -> None:
        self.store, self.other = store, other

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def compare_set(self, key, expected, desired):
        if key.endswith("/closing") and expected and self.other is not None:
            other, self.other = self.other, None
            other()
        return self.store.compare_set(key, expected, desired)


@pytest.mark.parametrize("sealing", SEALINGS.values(), ids=SEALINGS.keys())
def test_of_two_arrivals_that_take_a_closing_over_at_once_one_closes(ended, sealing) -> None:
    store, opened = _store(), []
    _closed_by(store, "b", f"t@{ended}", sealing, opened)
    second = lambda: opened.append(("second", _rank_arrives(store, "b", sealing, opened, "second")))  # noqa: E731
    raced = _RacedAtTakeOver(store, second)
    assert not _rank_arrives(raced, "b", sealing, opened, who="first")
    assert opened == ["closer", "second", ("second", True)]
    assert barrier.raised(store, barrier.release_key("b"), sealing)


def test_a_closer_token_names_this_process() -> None:
    token = barrier.closer_token()
    random, at, identity = token.partition("@")
    assert at and len(random) == 16 and identity == processes.identity()
    assert barrier.closer_token() != token


def test_a_timeout_with_every_participant_there_says_the_closer_did_not_release(ended) -> None:
    store, opened = _store(), []
    _closed_by(store, "b", f"t@other-{ended}", None, opened)  # another host's: left to it
    with pytest.raises(barrier.BarrierTimeout) as caught:
        barrier.wait(store, "b", 2, 0.1)
    assert caught.value.missing == []
    assert "all 2 participants arrived, but the arrival that completed it did not release it" in str(caught.value)
