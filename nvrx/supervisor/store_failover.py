"""Store failover: when the store host is lost, the lowest surviving slot not known lost
starts the next store.

The job directory (``<log dir>/<job id>``) is on a file system every node
sees (the checkpoint flag relies on it too), and it is where the survivors
meet, since the store is gone. Each run of the job (``SLURM_RESTART_COUNT``)
has its own failover directory, and each store of it its own snapshot; node 0 clears those of every run
when it starts, so nothing of an earlier run with the same job id is read, and
removes its run's once every slot ended (``forget_run``): only a killed run's
stay until the next run starts. For
failover ``epoch`` (1 for the first):

1. every survivor writes ``failover/run<N>/e<epoch>/alive-<slot>``;
2. once every slot has written but the lost host and the slots known lost
   (the host lost at the failover before, and those whose end the lost store's
   snapshot shows: they left, or were declared lost), or ``settle_s`` has passed,
   the lowest slot that wrote and is not known lost is the successor (a
   documented, deterministic rule that every survivor computes from the files it
   finds then), provided a majority of the job's slots wrote: a minority cut off
   by a partition never starts a store of its own, it stops. A slot known lost
   does not stand: one that finds its own end in that snapshot writes nothing and
   ends as fenced (``failover``). One that writes all the same counts toward the
   majority, but is never the successor and nobody waits for it: one that writes
   while the others look, like any slot that writes as ``settle_s`` passes, may
   make them find a majority or not (or name different successors), and then
   step 3 keeps it to one store;
3. the successor starts a store service on its own host, restored from the
   snapshot the old store kept (``nvrx.store.snapshot``), and claims the epoch
   for it by creating ``failover/run<N>/e<epoch>/claim.json`` exclusively: there is at
   most one new store per epoch (a slot that lost the claim stops its store and waits
   like the others, and a survivor connects to the store published, whichever
   successor it named);
4. the claimant decides the epoch for its store (see below), records the old
   host's slot lost in its store (so ranks that no spare replaces are marked gone
   before any child of the new generation can look), then publishes the address
   in ``failover/run<N>/e<epoch>/store.json``;
5. the others wait for that file and connect to the address in it.

A survivor that cannot see the file system (a partition) never learns an
address and stops; so does every survivor when no store address comes within
the store timeout plus the node timeout. When fewer than a majority announced
themselves, or no address came, the first of them whose node answers SLURM to create
``failover/run<N>/e<epoch>/requeue-claim`` exclusively is the one that asks SLURM about
the job's nodes and may requeue it (``failover``); one that was alone in its election and
requeued nothing gives the claim back (``release_requeue``): its store may have been lost
for it alone, and the others count the same epoch at their own failover.

What becomes of the epoch is decided once, by whoever first creates
``failover/run<N>/e<epoch>/decided`` exclusively (``decide``): the claimant, before it
uses its store (``store``), or that survivor, just before it records nodes lost and
requeues (``requeue``). The one that comes second backs off: a claimant that was only
slow stops its store, unpublished, for a job already requeued without it, and no job is
requeued around a store that was published. A store decided but still unpublished after
the store timeout is given up by that survivor (``abandon``: ``store.json`` created
exclusively, holding no address), and then its claimant cannot publish it either: before
it requeues the job, or, when the job is not requeued (its batch host still runs, or it
has none), once SLURM found the claimant's node running no step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nvrx import jobenv

log = logging.getLogger(__name__)

#: How often the shared directory is looked at while waiting (no change
#: notification works across the nodes of a shared file system).
_LOOK_S = 0.05


@dataclass(frozen=True)
class StoreAddress:
    """Where the store of one epoch serves, and which slot hosts it."""

    host: str
    port: int
    slot: int
    epoch: int


def _run() -> str:
    """This run's name in the failover files: ``run<N>``, N as every reader of the count takes
    it (``jobenv.slurm_restart_count``; a bad one stopped the supervisor as it started)."""
    return f"run{jobenv.slurm_restart_count()}"


def epoch_dir(job_dir: Path, epoch: int) -> Path:
    return job_dir / "failover" / _run() / f"e{epoch}"


def beats_dir(job_dir: Path, store: str) -> Path:
    """Where a slot whose beats in ``store`` (its host and port) are held still stamps its
    beats instead (``nvrx.store.ring.RingPlace``, for
    ``nvrx.node_agent.supervised.NodeDuty``): one folder per store, so that a node cut off with an old store does not stamp for the ring of the new
    one; removed with this run's failover files."""
    return job_dir / "failover" / _run() / "beats" / store


def snapshot_path(job_dir: Path, epoch: int = 0, slot: int = 0) -> Path:
    """Where the store of failover ``epoch`` (node 0's: 0) hosted by ``slot`` keeps its
    snapshot of the job-level keys, and where the successor of that store restores them
    from. One file per store: a store host that stalled, was failed over and wakes up again
    keeps writing its own store's keys until it fences itself, and a store started for an
    epoch on a slot that did not become its host writes until it is stopped; neither may
    replace the keys of the store that serves the job (a later failover would restore a job
    from before the first)."""
    return job_dir / "store" / f"snapshot-{_run()}-e{epoch}-s{slot}.json"


def reset(job_dir: Path) -> None:
    """Node 0, before this run's first store: forget the failovers and snapshots of every
    earlier run of this id (one killed left them; no later run reads them)."""
    for run in (job_dir / "failover").glob("run*"):
        shutil.rmtree(run, ignore_errors=True)
    for snapshot in (job_dir / "store").glob("snapshot-run*.json"):
        snapshot.unlink(missing_ok=True)


def forget_run(job_dir: Path) -> None:
    """The store host, once every slot ended and its store stopped: this run's failover
    files and snapshot serve nobody any more (a requeued run starts from none)."""
    shutil.rmtree(job_dir / "failover" / _run(), ignore_errors=True)
    for snapshot in (job_dir / "store").glob(f"snapshot-{_run()}-e*.json"):
        snapshot.unlink(missing_ok=True)
    for directory in (job_dir / "failover", job_dir / "store"):
        with contextlib.suppress(OSError):  # another run's files still there: kept
            directory.rmdir()


def withdraw(job_dir: Path, epoch: int, slot: int) -> None:
    """A survivor that found no majority takes back its announcement."""
    (epoch_dir(job_dir, epoch) / f"alive-{slot}").unlink(missing_ok=True)


def announce(job_dir: Path, epoch: int, slot: int) -> None:
    """This slot survived the store host and takes part in the election of ``epoch``."""
    directory = epoch_dir(job_dir, epoch)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"alive-{slot}").write_text(str(os.getpid()))


def _alive_slots(job_dir: Path, epoch: int) -> set[int]:
    slots = set()
    for path in epoch_dir(job_dir, epoch).glob("alive-*"):
        suffix = path.name.removeprefix("alive-")
        if suffix.isdigit():
            slots.add(int(suffix))
    return slots


@dataclass(frozen=True)
class Election:
    """What one survivor found in the election of an epoch."""

    alive: frozenset[int]  # the slots that announced themselves
    #: the lowest of them not known lost; None without a majority of the job's slots
    successor: int | None


def elect(
    job_dir: Path, epoch: int, expected: set[int], settle_s: float, nslots: int,
    known_lost: frozenset[int] = frozenset(),
) -> Election:  # fmt: skip
    """The slots that announced themselves once ``expected`` all did or ``settle_s`` passed,
    and the successor among them: none when fewer than a majority of the ``nslots`` slots did.
    A slot of ``known_lost`` that announced itself counts toward the majority but is never
    the successor: the job gave it up, so it hosts none of the job's stores."""
    deadline = time.monotonic() + settle_s
    while True:
        alive = _alive_slots(job_dir, epoch)
        if expected <= alive or time.monotonic() >= deadline:
            if 2 * len(alive) <= nslots:
                log.error("only slots %s of %d survived: no majority, no new store", alive, nslots)
                return Election(frozenset(alive), None)
            candidates = alive - known_lost
            return Election(frozenset(alive), min(candidates) if candidates else None)
        time.sleep(_LOOK_S)


def _create_first(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``; False when it exists (another slot created it first)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return True


def claim(job_dir: Path, address: StoreAddress) -> bool:
    """Claim ``address.epoch`` for the store at ``address``; False when another slot did first."""
    return _create_first(epoch_dir(job_dir, address.epoch) / "claim.json", json.dumps(asdict(address)))


def claim_requeue(job_dir: Path, epoch: int, slot: int) -> bool:
    """Whether ``slot`` is the one survivor of the failed election of ``epoch`` that asks SLURM
    about the job's nodes and requeues it (the first to create ``requeue-claim``)."""
    return _create_first(epoch_dir(job_dir, epoch) / "requeue-claim", str(slot))


def release_requeue(job_dir: Path, epoch: int, slot: int) -> None:
    """``slot`` gives back its claim of ``epoch``'s requeue: it was alone in that election
    and requeued nothing (the job's batch host answers: the store was lost for it alone,
    maybe), so the others, who still count that epoch next, may claim it when their store
    host is lost for real."""
    path = epoch_dir(job_dir, epoch) / "requeue-claim"
    with contextlib.suppress(FileNotFoundError):
        if path.read_text() == str(slot):
            path.unlink()


#: The two fates of an epoch (``decide``): its claimant's store serves, or the job is requeued.
STORE, REQUEUE = "store", "requeue"


def decide(job_dir: Path, epoch: int, outcome: str) -> bool:
    """Whether ``outcome`` (``STORE`` or ``REQUEUE``) is what becomes of ``epoch``: True for
    the first caller, which creates ``decided``; False when the other outcome came first.
    Each outcome has one caller per epoch (its claimant, the one survivor that claimed the
    requeue)."""
    return _create_first(epoch_dir(job_dir, epoch) / "decided", outcome)


def decided(job_dir: Path, epoch: int) -> bool:
    """Whether ``epoch`` was decided (``decide``), looked at without deciding it."""
    return (epoch_dir(job_dir, epoch) / "decided").exists()


def publish(job_dir: Path, address: StoreAddress) -> bool:
    """Tell the others where the store of ``address.epoch`` serves (its claimant only); False
    when the survivor that asked SLURM gave it up first (``abandon``). Created
    exclusively: a reader that finds it half written takes it for not there yet
    (``read_address``)."""
    return _create_first(epoch_dir(job_dir, address.epoch) / "store.json", json.dumps(asdict(address)))


def abandon(job_dir: Path, epoch: int) -> bool:
    """The survivor that asked SLURM gives up waiting for the store decided for ``epoch``:
    True when no address was published first, and then none ever is."""
    return _create_first(epoch_dir(job_dir, epoch) / "store.json", "abandoned")


def read_address(path: Path) -> StoreAddress | None:
    try:
        data = json.loads(path.read_text())
        return StoreAddress(str(data["host"]), int(data["port"]), int(data["slot"]), int(data["epoch"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not there yet, or half written


def claimed(job_dir: Path, epoch: int) -> bool:
    """Whether a store was claimed for ``epoch``."""
    return (epoch_dir(job_dir, epoch) / "claim.json").exists()


def claimant(job_dir: Path, epoch: int) -> int | None:
    """The slot whose store claimed ``epoch``; None when none did (or its claim is unreadable)."""
    address = read_address(epoch_dir(job_dir, epoch) / "claim.json")
    return None if address is None else address.slot


def superseded(job_dir: Path, epoch: int) -> bool:
    """Whether a majority elected a store after the store of ``epoch`` (it is claimed)."""
    return claimed(job_dir, epoch + 1)


def wait_address(job_dir: Path, epoch: int, timeout: float) -> StoreAddress | None:
    """The address the successor of ``epoch`` published, None when none came in ``timeout``."""
    path = epoch_dir(job_dir, epoch) / "store.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        address = read_address(path)
        if address is not None:
            return address
        time.sleep(_LOOK_S)
    return None
