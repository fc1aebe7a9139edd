"""Demo job: a small CPU model trained with gloo all_reduce, checkpointed, with injected faults.

Run under ``nvrx-supervise`` (see ``scripts/demo.sh``), which sets RANK,
WORLD_SIZE and the NVRX_* variables. Faults (``--fault KIND:STEP:RANK`` or
``NVRX_DEMO_FAULTS``, see ``fault_injection.py``) make ranks raise, hang, die
or stop the job (exit 130); the job resumes from its last checkpoint and
finishes at full size.

By default the training function runs inside the in-process ``Wrapper``:

* an exception or a hang (caught by the soft timeout) restarts every rank
  in-process: no process ends, each rank re-enters the function, calls
  ``init_process_group`` again and resumes from the step it kept in memory;
* a dead process is replaced by its supervisor, while its peers restart
  in-process and wait for the replacement to rejoin the next round; the
  replacement receives the kept state from a peer.

Each rank commits its model and optimizer state to memory after every step
(``KeptState``); the file checkpoint is read only when no live rank holds the
state (``--no-kept-state``: always, as the demo did before kept state).

``--no-wrapper`` keeps the plain script: every fault costs a process restart
of all ranks (a peer of a failed rank sees gloo's "connection closed" and
exits too), a hung rank is ended by a ``faulthandler`` watchdog, and ranks
agree on a fresh process-group generation through a counter in the store.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import hashlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The Wrapper's monitor thread waits on the store in slices, and torch logs the end of
# each slice as a warning: quiet by default (TORCH_CPP_LOG_LEVEL=WARNING shows them).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from fault_injection import FaultInjector, parse_faults  # noqa: E402

import nvrx  # noqa: E402
from nvrx import events  # noqa: E402
from nvrx.inprocess import CallWrapper  # noqa: E402


class PeerLost(RuntimeError):
    """A collective failed because another rank failed: a collateral fault, not this rank's own."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument(
        "--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)"
    )
    p.add_argument(
        "--step-time",
        type=float,
        default=0.05,
        help="extra seconds per step, so faults land mid-job",
    )
    p.add_argument(
        "--run-dir",
        default=None,
        help="checkpoints and fault markers (default: $NVRX_LOG_DIR/$NVRX_JOB_ID/run)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:STEP:RANK",
        help="inject a fault (repeatable; also NVRX_DEMO_FAULTS, comma-separated)",
    )
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=None,
        help="gloo collective timeout in seconds (default: 2/3 of --hard-timeout under the "
        "Wrapper, which wants it below its hard timeout, see docs/abort.md; 20 for a plain script)",
    )
    wrapper = p.add_argument_group("in-process Wrapper")
    wrapper.add_argument(
        "--no-wrapper",
        action="store_true",
        help="plain script: every fault restarts the processes of all ranks",
    )
    wrapper.add_argument(
        "--no-kept-state",
        action="store_true",
        help="resume every round from the file checkpoint instead of the state kept in memory",
    )
    wrapper.add_argument(
        "--soft-timeout",
        type=float,
        default=5.0,
        help="seconds without progress before every rank restarts in-process (default 5)",
    )
    wrapper.add_argument(
        "--hard-timeout",
        type=float,
        default=12.0,
        help="seconds without progress before a rank is killed (default 12)",
    )
    wrapper.add_argument(
        "--rejoin-timeout",
        type=float,
        default=60.0,
        help="seconds peers wait for the replacement of a dead process (default 60)",
    )
    wrapper.add_argument(
        "--max-iterations",
        type=int,
        default=20,
        help="restarts (in-process and process) before the job gives up (default 20)",
    )
    wrapper.add_argument(
        "--active-ranks",
        type=int,
        default=None,
        metavar="N",
        help="train on N ranks; the others wait as in-process spares and step in for "
        "ranks that leave (default: every rank trains)",
    )
    plain = p.add_argument_group("plain script (--no-wrapper)")
    plain.add_argument(
        "--hang-timeout",
        type=float,
        default=15.0,
        help="seconds without a step before a rank ends itself",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1:
        p.error(
            f"--steps and --checkpoint-every must be >= 1, got {args.steps}, {args.checkpoint_every}"
        )
    if args.active_ranks is not None and args.active_ranks < 1:
        p.error(f"--active-ranks must be >= 1, got {args.active_ranks}")
    if not 0 < args.soft_timeout < args.hard_timeout:
        p.error(
            f"need 0 < --soft-timeout < --hard-timeout, got {args.soft_timeout:g} and {args.hard_timeout:g}"
        )
    if args.pg_timeout is None:
        args.pg_timeout = 20.0 if args.no_wrapper else args.hard_timeout * 2 / 3
    if args.pg_timeout <= 0:
        p.error(f"--pg-timeout must be > 0, got {args.pg_timeout:g}")
    return args


def build_model(torch: Any) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )


def batch(torch: Any, step: int, rank: int, size: int = 64) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 32, generator=gen)
    w = torch.linspace(-1.0, 1.0, 32).unsqueeze(1)
    return x, x @ w + 0.01 * torch.randn(size, 1, generator=gen)


def save_checkpoint(torch: Any, path: Path, step: int, model: Any, opt: Any) -> None:
    """Write the checkpoint atomically: a private temporary file, then a rename over the old one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)


def _record_checkpoint(path: Path, step: int, action: str) -> None:
    record = getattr(nvrx, "record_checkpoint", None)
    if record is not None:
        record(path, step, action=action)
    else:
        events.emit("checkpoint", path=str(path), step=step, action=action)


#: Slice of a collective's wait (see ``wait_in_slices``).
WAIT_SLICE_S = 0.25


def say(line: str) -> None:
    """One line on stdout in one write, so lines of ranks sharing the terminal do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def wait_in_slices(work: Any, slice_s: float) -> None:
    """Wait for an asynchronous collective, returning to Python between slices.

    A rank waiting for a hung peer is not hung itself. The Wrapper's progress
    watchdog sees a main thread that runs Python code, so between slices the
    waiting ranks keep showing progress: only the rank that stopped goes stale,
    and the soft timeout writes that rank's stack, not a waiting peer's. A wait
    that never ends is still ended by the collective's own timeout (``--pg-timeout``).
    """
    while True:
        try:
            work.wait(timedelta(seconds=slice_s))
            return
        except RuntimeError:
            if work.is_completed():  # failed (or finished just now): its own result decides
                work.wait()
                return


class Trainer:
    """One process-group lifetime of training: model, optimizer, checkpoint, fault injection.

    ``peer_wait``: seconds to wait, after a collective failed, for the Wrapper's
    restart before raising ``PeerLost`` (0: raise at once).
    """

    def __init__(self, args: argparse.Namespace, run_dir: Path, peer_wait: float = 0.0) -> None:
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.args = torch, dist, args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.peer_wait = peer_wait
        self.ckpt = run_dir / "checkpoint.pt"
        self.injector = FaultInjector(
            parse_faults(args.fault, os.environ.get("NVRX_DEMO_FAULTS")), self.rank, run_dir
        )
        self.model = build_model(torch)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.5)  # state to keep
        self.loss = 0.0

    def _collective(self, what: str, start: Callable[[], Any]) -> None:
        """Run one collective; a failure (a peer died, hung or was restarted) raises ``PeerLost``.

        Under the Wrapper such a failure comes from a peer's fault that is
        already being handled: the restart interrupts the wait of ``peer_wait``
        and this rank reports no fault of its own.
        """
        failure: RuntimeError | None = None
        try:
            wait_in_slices(start(), WAIT_SLICE_S)
        except RuntimeError as exc:
            failure = exc
        if failure is not None:
            if self.peer_wait > 0:
                time.sleep(
                    self.peer_wait
                )  # outside the except block: a restart here has no context
            raise PeerLost(f"{what} failed: {failure}") from failure

    def resume_checkpoint(self) -> int | None:
        """``resume`` for ``KeptState``'s fallback: None when there was nothing to load."""
        return self.resume() or None

    def resume(self) -> int:
        """Load the latest checkpoint; every rank then takes rank 0's step and weights.

        Rank 0 is the only writer, so its view is the newest: the broadcast keeps
        every rank on the same step even if a save landed between two loads.
        """
        torch = self.torch
        start = 0
        if self.ckpt.exists():
            state = torch.load(self.ckpt)
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            start = int(state["step"])
            _record_checkpoint(self.ckpt, start, "load")
        params = list(self.model.parameters())
        flat = torch.cat([torch.tensor([float(start)])] + [p.detach().reshape(-1) for p in params])
        self._collective(
            "broadcast of the checkpoint", lambda: self.dist.broadcast(flat, src=0, async_op=True)
        )
        offset = 1
        with torch.no_grad():
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return int(flat[0].item())

    def step(self, step: int) -> None:
        self.injector.at_step(step)
        torch = self.torch
        x, y = batch(torch, step, self.rank)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        params = list(self.model.parameters())
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        self._collective(
            f"all_reduce at step {step}", lambda: self.dist.all_reduce(grads, async_op=True)
        )
        grads /= self.world
        offset = 0
        for p in params:
            p.grad.copy_(grads[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        self.opt.step()
        self.loss = float(loss.detach())
        time.sleep(self.args.step_time)

    def digest(self) -> str:
        """A digest of the model's and the optimizer's state: in data-parallel training it is
        the same on every rank after every step, a replacement's and a spare's included."""
        sha = hashlib.sha256()
        for tensor in [*self.model.state_dict().values(), *_optimizer_tensors(self.opt)]:
            sha.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
            sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        sha.update(repr(groups).encode())  # learning rate, momentum...
        return sha.hexdigest()[:16]

    def checkpoint_due(self, step: int) -> bool:
        return step % self.args.checkpoint_every == 0 or step == self.args.steps

    def save(self, step: int) -> None:
        if self.rank == 0:
            save_checkpoint(self.torch, self.ckpt, step, self.model, self.opt)
            _record_checkpoint(self.ckpt, step, "save")

    def finish(self) -> None:
        """Agree on the final world size, tell it (rank 0), leave the process group together."""
        final = self.torch.tensor([1.0])
        self._collective("final all_reduce", lambda: self.dist.all_reduce(final, async_op=True))
        if self.rank == 0:
            say(
                f"[demo] finished {self.args.steps} steps at world size {int(final.item())}, "
                f"loss {self.loss:.4f}; events in {events.job_log_dir()}"
            )
        # gloo can abort a process at exit when a peer tore its group down first
        self._collective("final barrier", lambda: self.dist.barrier(async_op=True))
        self.dist.destroy_process_group()


def _optimizer_tensors(opt: Any) -> list[Any]:
    """The tensors of an optimizer's state (momentum buffers...), in a fixed order."""
    state = opt.state_dict()["state"]
    return [v for key in sorted(state) for _, v in sorted(state[key].items()) if hasattr(v, "numpy")]


@contextlib.contextmanager
def _no_guard() -> Iterator[None]:
    yield


def train_loop(
    trainer: Trainer,
    start: int,
    before_step: Callable[[], None],
    atomic: Callable[[], contextlib.AbstractContextManager[None]],
    kept: Any = None,
) -> None:
    """Steps ``start+1 .. --steps``, each committed to ``kept`` when given and told by a
    progress event; a file checkpoint (rank 0, inside ``atomic``) every few steps."""
    writer = events.get_writer()
    for step in range(start + 1, trainer.args.steps + 1):
        before_step()
        trainer.step(step)
        if kept is not None:
            kept.commit(step)
        if trainer.checkpoint_due(step):
            with atomic():
                trainer.save(step)
        writer.emit("progress", step=step, loss=trainer.loss, state_digest=trainer.digest())


def run_dir_of(args: argparse.Namespace) -> Path:
    run_dir = Path(args.run_dir) if args.run_dir else events.job_log_dir() / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# -- with the in-process Wrapper ------------------------------------------------------------


def make_wrapper(args: argparse.Namespace) -> Any:
    """The Wrapper with timeouts sized for the demo (steps of ~0.1 s, restarts in seconds)."""
    from nvrx import inprocess

    extra: dict[str, Any] = {}
    if args.active_ranks is not None:  # the default assignment activates every rank
        extra["rank_assignment"] = inprocess.Compose(
            inprocess.rank_assignment.MaxActiveWorldSize(args.active_ranks),
            inprocess.rank_assignment.ShiftRanks(),
        )
    return inprocess.Wrapper(
        **extra,
        initialize=inprocess.initialize.RetryController(max_iterations=args.max_iterations),
        abort=inprocess.abort.AbortTorchDistributed(),
        soft_timeout=args.soft_timeout,
        hard_timeout=args.hard_timeout,
        heartbeat_interval=0.5,
        heartbeat_timeout=10.0,
        monitor_process_interval=0.5,
        progress_watchdog_interval=0.5,
        last_call_wait=0.3,
        termination_grace_time=2.0,
        barrier_timeout=max(60.0, args.hard_timeout + 10.0),
        completion_timeout=60.0,
        rejoin_timeout=args.rejoin_timeout,
    )


@functools.cache
def process_kept_state() -> Any:
    """This process's ``KeptState``: it outlives the rounds, as the process does."""
    from nvrx.inprocess import KeptState

    return KeptState()


def kept_state(trainer: Trainer) -> Any:
    """The process's ``KeptState``, bound to this round's new model and optimizer."""
    kept = process_kept_state()
    kept.register("model", trainer.model, replace=True)
    kept.register("optimizer", trainer.opt, replace=True)
    return kept


def wrapped_round(args: argparse.Namespace, call_wrapper: CallWrapper | None = None) -> None:
    """One round inside the Wrapper: join a fresh process group, resume, train to the end.

    The Wrapper sets RANK/WORLD_SIZE/MASTER_* for the round, so a plain
    ``init_process_group`` from the environment works in every round.
    """
    import torch.distributed as dist

    run_dir = run_dir_of(args)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    # the Wrapper's round, not its iteration: a new process generation's rounds jump ahead
    round_ = call_wrapper.round if call_wrapper is not None else 0
    events.get_writer().update(rank=dist.get_rank(), round=round_)
    trainer = Trainer(args, run_dir, peer_wait=args.soft_timeout / 2)
    kept = None if args.no_kept_state else kept_state(trainer)
    if kept is None:
        start = trainer.resume()
    else:
        start = kept.restore_agreed(events=call_wrapper, checkpoint=trainer.resume_checkpoint) or 0
    say(
        f"[demo] rank {trainer.rank}/{trainer.world} pid {os.getpid()} starts at step {start} "
        f"(iteration {iteration}, process restart {os.environ.get('NVRX_RESTART_COUNT', '0')})"
    )
    atomic = call_wrapper.atomic if call_wrapper is not None else _no_guard
    train_loop(trainer, start, lambda: None, atomic, kept)
    trainer.finish()


def import_before_the_wrapper() -> None:
    """Import what training imports lazily (the optimizer pulls in ``torch._dynamo``), once,
    before the Wrapper runs: on a loaded machine the import can outlast the soft timeout, and
    a restart that interrupts an import leaves the module half imported for every later round."""
    import torch

    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


def train_wrapped(args: argparse.Namespace) -> int:
    run_dir_of(args)
    import_before_the_wrapper()
    writer = events.configure("app")
    emit_process_start(writer)
    make_wrapper(args)(wrapped_round)(args)
    writer.emit("process_end", exit_code=0, reason="training completed")
    return 0


# -- plain script (--no-wrapper) ------------------------------------------------------------


def join_generation(store: Any, rank: int, world: int, timeout: float) -> int:
    """Process-group generation this process joins, once every rank joined it.

    A process that replaces one of this rank declares the generation its
    predecessor died in broken, once (compare-and-set), and everyone joins the
    current generation. Peers of the dead process fail in their collectives,
    and their replacements find the generation already moved on. Counting
    starts instead would drift for good once a rank failed twice in a round.
    The ones already waiting in a generation declared broken are told at once
    and join the next: none waits out a timeout for peers that went elsewhere.
    """
    while True:
        generation = _enter_generation(store, rank)
        ready = f"demo/join{generation}/ready"
        if store.add(f"demo/join{generation}/arrived", 1) == world:
            store.compare_set(ready, "", "all")
        store.wait([ready], timedelta(seconds=timeout))
        if store.get(ready) == b"all":
            return generation


def _enter_generation(store: Any, rank: int) -> int:
    current = int(store.add("demo/generation", 0))
    key = f"demo/generation_of/{rank}"
    if store.check([key]):
        previous = int(store.get(key))
        if previous == current:
            store.compare_set("demo/generation", str(previous), str(previous + 1))
            store.compare_set(f"demo/join{previous}/ready", "", "broken")
        current = int(store.add("demo/generation", 0))
    store.set(key, str(current))
    return current


#: ``process_end``'s reason in a process that found nothing left to train.
ALREADY_FINISHED = "training had already finished"


def emit_process_start(writer: Any) -> None:
    """This process's ``process_start`` event: how it was started, which local rank it is."""
    writer.emit("process_start", argv=sys.argv, local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def finished_step(ckpt: Path, steps: int) -> int | None:
    """The last step, when the checkpoint says training got there; None otherwise.

    A process can die after it finished training (gloo may abort it at exit when
    a peer tore the group down first); the supervisor then starts a replacement,
    whose peers are gone. It must see that there is nothing left to do and exit 0
    rather than wait for a process group that will never form.
    """
    if not ckpt.exists():
        return None
    import torch

    step = int(torch.load(ckpt)["step"])
    return step if step >= steps else None


def train_plain(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = run_dir_of(args)
    writer = events.configure("app")
    finished = finished_step(run_dir / "checkpoint.pt", args.steps)
    if finished is not None:
        emit_process_start(writer)
        say(f"[demo] rank {rank}/{world}: training already finished at step {finished}")
        writer.emit("process_end", exit_code=0, reason=ALREADY_FINISHED)
        return 0
    store = dist.TCPStore(
        os.environ["NVRX_STORE_HOST"],
        int(os.environ["NVRX_STORE_PORT"]),
        world_size=None,
        is_master=False,
        timeout=timedelta(seconds=60),
        wait_for_workers=False,
    )
    generation = join_generation(store, rank, world, 3 * args.pg_timeout)
    writer.update(round=generation)
    emit_process_start(writer)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"demo/gen{generation}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    trainer = Trainer(args, run_dir)
    start = trainer.resume()
    say(
        f"[demo] rank {rank}/{world} generation {generation} starts at step {start} "
        f"(restart {os.environ.get('NVRX_RESTART_COUNT', '0')})"
    )

    def watchdog() -> None:  # a hung rank dumps its stack and exits
        faulthandler.dump_traceback_later(args.hang_timeout, exit=True)

    train_loop(trainer, start, watchdog, _no_guard)
    faulthandler.cancel_dump_traceback_later()
    trainer.finish()
    writer.emit("process_end", exit_code=0, reason="training completed")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    try:
        return train_plain(args) if args.no_wrapper else train_wrapped(args)
    except Exception as exc:
        here = Path(__file__).resolve().parent
        frames = [
            f
            for f in traceback.extract_tb(exc.__traceback__)
            if Path(f.filename).resolve().parent == here
        ]
        frame = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
        events.emit(
            "fault",
            fault_kind="peer" if isinstance(exc, PeerLost) else "exception",
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc)[:2000],
            traceback=traceback.format_exc()[-8000:],
            signature=f"{type(exc).__qualname__}@{Path(frame.filename).name}:{frame.lineno}",
        )
        raise


if __name__ == "__main__":
    sys.exit(main())
