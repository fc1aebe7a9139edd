"""The node agent: one small process per node that owns the node's liveness.

One program in both modes (``python -m nvrx.node_agent``). Under a supervisor, the
supervisor starts it (``supervised``); in a Wrapper job without one, the first rank
monitor of a host that finds no agent starts it (``host``, ``nvrx.inprocess.agent_link``).
Either way it

* reads the beats of the node's rank monitors, in one loop (``nvrx.node_agent.rank_wire``:
  ``BeatLoop``, the beats as they come, a rank's silence at its deadline);
* beats for its node in the ring of liveness and watches the next party's beat, reading
  the claims and fences (``nvrx.store.ring``);
* meets the round protocol's barriers for the node's ranks: one arrival at the store for
  all of them (``rank_wire``: ``BarrierRelay``);
* runs no user code and imports no torch, so that training code cannot hang it.

What differs is its duty, the ``BeatLoop``'s other half: who decides on a silent rank or
node. Under a supervisor, the supervisor does (it knows its children, and node roles
follow): the agent tells it, and is also its store client (``supervised``: ``NodeDuty``,
and the JSON lines it serves). Without one, the agent decides and takes silent ranks and
hosts out of the running round itself (``host``: ``NodeAgent``).
"""
