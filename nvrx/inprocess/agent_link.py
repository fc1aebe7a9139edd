"""A rank's monitor's end of its host's node agent, without a supervisor: its beats go
there, and the first monitor that finds no agent starts one.

A monitor writes its rank into its host's list in the store (``nvrx.store.host_ring``)
before its rank goes on, then beats to the agent's abstract socket
(``nvrx.node_agent.host.agent_address``). A beat that finds nobody listening binds that
address itself: binding is the host's lock, one monitor wins and the others' beats
queue in its socket. The winner starts the agent on that socket
(``python -m nvrx.node_agent host FD``, in a session of its own, so that it outlives the
monitor that started it; that monitor reaps it if it ends first), its ``HostConfig``
on its stdin. An agent that died is started again the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from nvrx import jobenv
from nvrx.node_agent.host import HostConfig, agent_address, host_key
from nvrx.node_agent.rank_wire import Beat, BeatSender, BeatSocket
from nvrx.store.host_ring import (
    claimed,
    end_rank,
    job_token,
    list_ended,
    list_rank,
    register,
)

from .monitor_process import MonitorConfig

log = logging.getLogger(__name__)


class AgentLink:
    """One monitor's beats to its host's agent, which it starts when none listens."""

    def __init__(self, cfg: MonitorConfig, store: Callable[[], Any]) -> None:
        self.cfg, self._store = cfg, store
        self.agent_cfg = HostConfig.of(cfg)  # what the host's agent is given of the job
        self.host = jobenv.host_id()
        self.agent_cfg.job_token = job_token(store())
        self.slot = self._listed(store())
        self.sender = BeatSender(
            agent_address(self.agent_cfg, self.host), "this host's node agent", logging.INFO
        )
        self._started: subprocess.Popen[bytes] | None = None

    def _listed(self, store: Any) -> int:
        """Write this rank into its host's list; the slot. A slot whose place ended meanwhile
        (its agent had not seen this rank yet, or another host declared it lost) is left for
        the host's next one, this rank listed as ended there: whoever ended it reads the list
        again after its claim, and leaves this rank alone."""
        key = host_key(self.agent_cfg, self.host)
        while True:
            slot = register(store, key)
            list_rank(store, slot, self.cfg.initial_rank)
            if not claimed(store, slot):
                return slot
            list_ended(store, slot, self.cfg.initial_rank)

    def beat(self, beat: Beat) -> None:
        """Send ``beat``; where no agent listens, bind its socket (the host's lock: one
        monitor wins) and start an agent on it. The beat waits in that socket's queue.
        Never raises: an agent that cannot start is tried again at the next beat."""
        self._reap()
        beat = dataclasses.replace(beat, slot=self.slot)  # the agent's place is its ranks'
        if self.sender.send(beat) or not self.sender.listener_gone or self._started is not None:
            return
        try:
            sock = BeatSocket(self.sender.path)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:  # else another monitor bound it: its agent starts
                log.warning("cannot listen for this host's node agent: %s", exc)
            return
        try:
            self._started = start_agent(self.agent_cfg, sock.fileno())
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("cannot start this host's node agent: %s", exc)
            return
        finally:
            sock.close(unlink=False)
        self.sender.send(beat)

    def _reap(self) -> None:
        if self._started is not None and self._started.poll() is not None:
            self._started = None

    def end(self, failed: bool = False) -> None:
        """This monitor stops beating: on purpose (its rank ended, died or hung, and this
        monitor took care of it), it says so in the store (in each place of its host that
        lists its rank: ``host_ring.end_rank``) and to the agent; ``failed``, it says
        nothing and the agent finds its rank silent. Never raises."""
        if not failed:
            try:
                key = host_key(self.agent_cfg, self.host)
                end_rank(self._store(), key, self.slot, self.cfg.initial_rank)
            except Exception as exc:  # the store may be gone at the job's end
                log.info("could not write that this monitor ends: %r", exc)
            bye = Beat(initial_rank=self.cfg.initial_rank, pid=self.cfg.target_pid, bye=True)
            self.sender.send(bye, wait_s=1.0)
        self.sender.close()
        self._reap()


def start_agent(cfg: HostConfig, fd: int) -> subprocess.Popen[bytes]:
    """Start a node agent for ``cfg``'s job and host, in a session of its own, on the
    socket ``fd`` bound at its address."""
    config = json.dumps(dataclasses.asdict(cfg))
    proc = subprocess.Popen(
        [sys.executable, "-m", "nvrx.node_agent", "host", str(fd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # never a launcher's pipe held open: it logs to a file
        start_new_session=True,
        pass_fds=(fd,),
    )
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError), proc.stdin:  # its configuration, not in ``ps``
        proc.stdin.write(config.encode() + b"\n")
    return proc
