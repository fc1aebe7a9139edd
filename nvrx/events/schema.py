"""The one schema of nvrx events: common fields and the documented kinds.

Every process of a job writes JSON lines of this shape. ``nvrx-report`` needs
nothing else to tell what happened, so a kind's fields are part of the public
contract: add fields freely, never rename or change the meaning of one, and
bump ``SCHEMA_VERSION`` when a change would mislead an older reader.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

#: Fields every event carries, with their meaning.
COMMON_FIELDS: dict[str, str] = {
    "v": "schema version (int)",
    "kind": "event kind, one of KINDS or a newer one a reader must tolerate",
    "wall": "wall-clock time, seconds since the epoch (float)",
    "mono": "time.monotonic() of the writing host (float); comparable only within one host boot",
    "boot": "identifier of the host boot, so monotonic times of one boot can be compared",
    "job": "job id (NVRX_JOB_ID when set, else SLURM_JOB_ID, else a local id)",
    "node": "node rank within the job (int, or null when unknown); a supervisor's events "
    "give its slot (a spare keeps it after it takes a node rank over)",
    "rank": "global rank of the writing process (int, or null for per-node processes)",
    "round": "restart round of the Wrapper/job when the event was written (int, or null)",
    "slurm_run": "which run of its SLURM job the writer runs in: SLURM_RESTART_COUNT, 0 when "
    "unset (int; a requeued job runs again under the same SLURM job id, its count one higher); "
    "null outside a SLURM job (no SLURM_JOB_ID) or when the count is not a non-negative "
    "integer; absent from older writers' events",
    "pid": "process id of the writer",
    "host": "host name of the writer",
    "component": "writer: wrapper, monitor, supervisor, store, launcher, app, ...",
}

#: Fields a writer stamps on every event it writes, beside the common ones.
STAMPED_FIELDS: dict[str, str] = {
    "initial_rank": "the rank the process started the job as, before any renumbering of a "
    "restart (on the events the in-process Wrapper's CallWrapper writes)",
}

#: Documented kinds, with the fields specific to each. Readers must accept
#: kinds missing from this table (from newer versions) and skip them.
KINDS: dict[str, dict[str, str]] = {
    # -- life of any process ------------------------------------------------
    "process_start": {"argv": "command line", "local_rank": "local rank when a training child"},
    "process_end": {"exit_code": "exit code the process is about to return", "reason": "why"},
    # -- in-process Wrapper -------------------------------------------------
    "round_start": {
        "world_size": "ranks taking part in this round",
        "active_world_size": "ranks running the function (others are spares)",
        "active_rank": "this rank's active rank, or null when a spare",
        "initial_rank": "rank the process had when the Wrapper started",
        "restart_latency_s": "seconds from the fault's detection to this round's start, after a restart",
        "iteration": "the Wrapper's iteration, the job's restarts so far (equals round in the job's "
        "first process generation; a later generation's rounds start at its own base)",
    },
    "call_start": {"note": "the wrapped function is entered (goodput starts counting)"},
    "call_end": {
        "duration_s": "time spent inside the wrapped function this round",
        "outcome": "completed | fault | restart (a restart reached it from outside: a peer's fault)",
    },
    "fault": {
        "fault_kind": "exception | hang_soft | hang_hard | dead | unresponsive | peer | signal | exit | node_lost | monitor_exception",
        "origin_rank": "rank that faulted first (this rank for a local fault)",
        "exc_type": "qualified exception type, when an exception",
        "message": "exception message or a description",
        "traceback": "formatted traceback, when available",
        "signature": "stable failure signature (type + innermost user frame, or signal/exit code)",
        "detected_mono": "monotonic time when the fault was detected on this host",
        "detection_s": "seconds from the fault to its detection, when known",
        "local_rank": "local rank of the faulted child (supervisor, unresponsive)",
        "child_pid": "pid of the faulted child (supervisor, unresponsive)",
        "rank_host": "host of the faulted rank where another host wrote the fault (the node "
        "agent that found its host silent, without a supervisor)",
        "rank_node": "node of the faulted rank: with rank_host; on a supervisor's unresponsive "
        "fault, the node rank it holds (a spare's events name its slot)",
    },
    "restart_phase": {
        "phase": "initial_barrier | last_call_wait (older versions) | abort | finalize | health_check | "
        "iteration_barrier | rank_assignment | initialize | termination_barrier | rejoin_wait | ...",
        "duration_s": "seconds the phase took",
        "ok": "whether the phase succeeded",
    },
    "restarter_state": {
        "state": "initialize | handling | finalized | aborted (nested-restarter protocol)",
        "stage": "starting | processing | completed, or null",
        "active_rank": "active rank of the reporting rank, or null",
    },
    "rank_change": {
        "old_rank": "rank before assignment",
        "new_rank": "rank after assignment (null when terminated)",
        "active": "whether the rank runs the function",
        "active_rank": "the rank's active rank after assignment, or null when a spare",
        "world_size": "ranks in the job after assignment",
    },
    "ranks_terminated": {"ranks": "ranks removed from the job this round (list of int)"},
    "hang": {
        "timeout": "soft | hard | progress | heartbeat (the Wrapper's); initial_heartbeat | "
        "heartbeat | section | out_of_section (the supervisor's, nvrx.fault_tolerance)",
        "stack": "stack dump of the hung rank's threads",
        "stale_s": "seconds without progress when the hang was declared",
        "section": "the section that stayed open too long (timeout section)",
        "limit_s": "the timeout that passed (supervisor)",
        "local_rank": "local rank of the hung child (supervisor)",
        "child_pid": "pid of the hung child, which the supervisor then ends (supervisor)",
        "message": "what timed out, in words (supervisor)",
    },
    "job_restart": {
        "epoch": "job-wide restart number (--ft-restart-policy any-failed)",
        "phase": "stopping (children stopped) | ready (this slot's ended) | started | "
        "timed_out (slots never became ready: without node liveness the job stops; with it, "
        "each is declared lost, node_lost cause never_ready, unless the store's host is one: "
        "then the job stops)",
        "cause": "rank, node and signature of the failure that started it, and the loop "
        "breaker's streak after it as [signature, count] (stopping; null where this node "
        "followed a claim before it read the announcement)",
        "ready": "slots ready so far (ready)",
        "nodes": "slots the restart waits for (ready)",
        "missing": "slots still in the job that never counted themselves ready (timed_out; "
        "null where the store could not tell)",
        "limit_s": "seconds this slot waited once it was ready: grace_period + store_timeout, "
        "+ node_timeout with node liveness (timed_out)",
    },
    "workload_control": {
        "action": "ExcludeThisNode | ShutdownWorkload | Continue",
        "description": "why, as the rank said",
        "local_rank": "local rank of the requesting child",
        "child_pid": "pid of the requesting child",
    },
    "non_retryable": {
        "pattern": "the pattern of --ft-non-retryable-exception-file that matched",
        "line": "the line of the exception text that holds it",
        "source": "error file | events: where the exception text came from",
        "global_rank": "rank that failed",
        "local_rank": "local rank of the failed child",
        "child_pid": "pid of the failed child",
    },
    "timeouts_set": {
        "source": "config | restored (at init_workload_monitoring) | computed: where the timeouts in force came from",
        "timeouts": "initial_heartbeat, heartbeat, sections, out_of_section (seconds or null) and "
        "computed (the names computed from observations)",
        "local_rank": "local rank of the monitored child",
        "child_pid": "pid of the monitored process",
    },
    "round_end": {
        "outcome": "completed | restart | terminated | abort",
        "duration_s": "seconds from round start to its end",
        "restart_latency_s": "seconds from fault detection to the next round start, when restarting",
        "faults": "fault records of the round (list of objects), when it ended in a restart",
    },
    "wrapper_end": {
        "outcome": "completed | restart_abort | left (the rank left the job, the others going "
        "on without it: terminated, discarded) | error",
        "rounds": "rounds run",
    },
    # -- supervisor and store service -------------------------------------
    "supervisor_start": {
        "nnodes": "nodes in the job",
        "nproc_per_node": "children per node",
        "command": "the training command",
        "store": "host:port of the external store",
        "spare_nodes": "spare nodes the job asked for",
        "spare": "whether this supervisor starts as a spare",
        "max_restarts": "job-wide restart budget",
        "loop_breaker": "same-signature failures in a row that stop the job",
        "supervisor_pid": "pid of the supervisor",
        "fault_tolerance": "the launcher-side monitoring settings (object; --ft-*)",
        "restart_policy": "which ranks a failed rank restarts (--ft-restart-policy)",
        "stragglers": "straggler detection: action, section and threshold (object)",
        "slurm_job_id": "SLURM_JOB_ID when SLURM runs the job (null otherwise): the id sacct "
        "knows, where the common field job is NVRX_JOB_ID",
        "slurm_array_job_id": "SLURM_ARRAY_JOB_ID of an element of a job array (null otherwise): "
        "the array's id, %A of SLURM's default output file slurm-%A_%a.out",
        "slurm_array_task_id": "SLURM_ARRAY_TASK_ID of an element of a job array (null "
        "otherwise): its index in the array, %a of slurm-%A_%a.out",
    },
    "store_start": {
        "addr": "the address clients reach the store at",
        "listen": "the address it listens on (all: every interface)",
        "port": "bind port",
        "restored_keys": "job-level keys restored from the job directory's snapshot (after a failover)",
    },
    "store_end": {"reason": "why the store service stopped"},
    "child_start": {
        "local_rank": "local rank of the child",
        "child_pid": "pid of the child",
        "global_rank": "RANK the child is started with",
        "attempt": "0 for the first start, n for the n-th restart of this local rank",
        "warm": "true when a warm standby (torch already imported) became the child",
        "files": "its directory, relative to the job's: error file and log files (rank_logs)",
    },
    "standby_start": {
        "standby_pid": "pid of a warm standby started ahead, to import torch before it has a rank",
        "purpose": "restart: the next child this supervisor starts, of whichever local rank",
    },
    "standby_ready": {
        "standby_pid": "pid of the standby, now warm: its imports and its monitor's are done",
        "purpose": "as in standby_start",
        "warm_up_s": "seconds from its start to warm",
    },
    "child_exit": {
        "local_rank": "local rank",
        "child_pid": "pid",
        "exit_code": "exit code, or null when killed by a signal",
        "signal": "signal name, or null",
        "runtime_s": "seconds the child ran",
        "global_rank": "RANK the child was started with",
        "attempt": "which start of this local rank ended (0 = first)",
        "error_file": "its error file (torch's @record), relative to the job's directory, or null",
    },
    "restart_decision": {
        "local_rank": "local rank the decision is about",
        "decision": "restart | stop | give_up",
        "reason": "why",
        "budget_left": "job-wide restarts left after this decision",
        "signature": "failure signature that counted towards the loop breaker",
        "global_rank": "RANK of the failed child",
        "scope": "rank (this child alone) | job (every rank of the job together, any-failed)",
    },
    "rejoin": {
        "local_rank": "local rank (supervisor side)",
        "wait_s": "seconds since the exit (supervisor) or that peers waited (wrapper)",
        "phase": "replacement_started (supervisor side)",
        "child_pid": "pid of the replacement (supervisor side)",
        "global_rank": "RANK the replacement is started with (supervisor side)",
        "rank_rejoined": "rank that came back (wrapper side)",
    },
    "node_lost": {
        "lost_node": "node rank the lost node held (null when it was a spare)",
        "lost_slot": "the lost supervisor's slot (SLURM_PROCID / --node-rank it started with)",
        "lost_host": "host of the lost node (SLURM node name under SLURM)",
        "silent_s": "seconds its supervisor had been silent when it was declared lost",
        "last_seen_wall": "wall time of its last sign of life, as the watcher saw it",
        "cause": "why it was declared lost: silent (its slot stopped beating, or it was lost "
        "with the store) | never_ready (its slot beat on, but its supervisor never counted "
        "itself ready for a job-wide restart: stuck; see job_restart timed_out) | excluded "
        "(it declared itself lost: ExcludeThisNode)",
        "seen_by": "slot of the supervisor that declared it lost",
        "slurm_state": "SLURM's view of the node (scontrol State, Reason), when it could be had",
        "action": "spare (a spare takes its node rank) | shrink (the job goes on smaller) | "
        "stop (no spare, below --min-nodes; or lost with the store, no successor elected or served) | "
        "none (a spare was lost, or its training had ended)",
        "replaced_by": "slot of the spare that takes over, when action is spare",
        "ranks": "global ranks the lost node held",
    },
    "rejected_write": {
        "key": "the store key whose value was refused",
        "reason": "why: no valid seal (not written by this job's processes in this run: "
        "forged, or replayed from another key, round or run)",
        "value_bytes": "length of the refused value (the value itself is not recorded)",
    },
    "straggler": {
        "of": "rank | node: what was named or cleared",
        "state": "slow (named a straggler) | recovered (cleared)",
        "who": "the global rank (of rank) or the slot (of node) named",
        "node_rank": "the training node rank of that node (of node), or of the rank's node",
        "slot": "the slot of the node (of node), or of the rank's node",
        "straggler_host": "host of that node",
        "ranks": "global ranks of that node (of node)",
        "score": "job reference step time / its own median step time, at most 1 (1: as fast as "
        "the job's fast ranks)",
        "median_s": "its median step time (own work) over the window (of node: the median of "
        "its ranks')",
        "reference_s": "the job's reference step time: the lower quartile of the ranks' medians "
        "(of two, the faster one's); of node, of the nodes' medians",
        "slower_pct": "how much slower than the reference, in percent",
        "step": "the step count its ranks had reached when it was judged (the least of them)",
        "window": "steps each median covers",
        "threshold": "score under which a rank or node is named",
        "action": "report (only named) | exclude (its supervisor is asked to leave the job, a "
        "spare taking over) | store_host (exclude asked, but the node hosts the job's store, "
        "which its leaving would move: only named) | none (exclude asked, but no spare is "
        "free: only named)",
        "source": "where the step times came from: record_step | section NAME",
    },
    "node_probe": {
        "lost_slot": "slot of the node declared lost (or of the store host, when no successor could be elected or served); "
        "null for a node asked before a requeue that did not happen (the job may not be requeued, say)",
        "lost_host": "its SLURM node name",
        "responding": "whether a no-op SLURM step ran on it (true: its supervisor was lost, "
        "not the node; null: unknown, the supervisor ended first)",
        "probe_s": "seconds the probe took (bounded by its timeout)",
        "note": "why the answer is false or unknown (null), when it is not the step's own exit",
    },
    "node_takeover": {
        "node_rank": "node rank this spare supervisor takes over",
        "lost_slot": "slot of the lost node it replaces",
        "wait_s": "seconds from the loss being declared to the takeover",
    },
    "store_failover": {
        "epoch": "store failovers so far in this job, this one included",
        "old_store": "host:port of the store that was lost",
        "new_store": "host:port of the store now serving the job",
        "successor": "slot of the supervisor that hosts the new store",
        "lost_slot": "slot of the lost store host",
        "duration_s": "seconds from this supervisor seeing the store lost to the new store serving it",
        "store_held": "the successor: whether its new store was the one it kept ready while "
        "the job ran (torch imported, bound at once), not one started at the failover; "
        "null on the other survivors",
    },
    "signal_received": {"signal": "signal name", "action": "what the receiver does about it"},
    "job_stop": {"reason": "why the job stops", "exit_code": "exit code the supervisor returns"},
    "supervisor_end": {"exit_code": "exit code", "reason": "why"},
    # -- SLURM --------------------------------------------------------------
    "preempt_signal": {
        "signal": "signal name",
        "cause": "preemption | time_limit | unknown",
        "window_s": "seconds left to checkpoint and stop",
        "decided_by": "scontrol | flag (another node decided) | caller | no SLURM",
        "TimeLimit": "scontrol's TimeLimit when the cause was read from it",
        "RunTime": "scontrol's RunTime then",
        "PreemptTime": "scontrol's PreemptTime then",
    },
    "state_restored": {
        "source": "memory (this rank's own kept state) | peer (it held none; received from a "
        "peer of its replica group) | checkpoint (no live peer held some shard, or nothing was "
        "kept: the user's checkpoint callback loaded it) | none (the same, and the callback "
        "found no checkpoint, or none was given: the caller restores its checkpoint itself)",
        "step": "the step restored (null when nothing was)",
        "newest_step": "the newest step any rank of the group had kept: the finished steps "
        "after step up to it are lost (the step running at the fault is trained again in "
        "any case, and not counted)",
        "committed_wall": "when this rank committed the step it restored, or received it "
        "from a peer after an earlier fault (source memory; null otherwise): the work after "
        "it, up to the fault, is lost",
        "duration_s": "seconds the agreement, hand-over and load took on this rank",
    },
    "checkpoint": {
        "path": "checkpoint written or loaded",
        "step": "training step",
        "action": "save | load",
    },
    "requeue": {
        "cause": "preemption | time_limit | node_failure",
        "count": "requeues so far (null when not counted)",
        "excluded": "nodes the requeued job may not run on (node_failure)",
        "answered": "lost nodes left out of excluded: they still ran a SLURM step, so their "
        "supervisor was lost, not the node (node_failure)",
        "exclude_error": "why SLURM did not add the lost nodes to excluded, which then keeps the "
        "nodes excluded before: the job was requeued all the same (node_failure; null when "
        "they were added)",
        "held": "true when SLURM did not release the requeued job: it waits held until someone "
        "runs scontrol release JOB (node_failure)",
        "required": "lost nodes left out of excluded because the job names them in --nodelist "
        "(its ReqNodeList): the requeued job runs only with them, so it waits pending while they "
        "are down (node_failure)",
        "exclude_refused": "lost nodes SLURM refused to add to excluded (exclude_error says why): "
        "the next run may land on them (node_failure; empty when they were added)",
        "slurm_job_id": "the SLURM job id requeued (SLURM_JOB_ID, which scontrol release and "
        "scancel take; the common field job is NVRX_JOB_ID when one is set) (node_failure)",
        "run": "which run of the job asked for the requeue (0 = the first submission; null when "
        "the writer does not know it)",
        "issued_by": "nvrx (the supervisor called scontrol requeue) | slurm (SLURM requeued it) | "
        "submitit-local (submitit's local executor runs the task again)",
    },
    # -- application progress (demo, examples) ---------------------------
    "progress": {
        "step": "training step reached",
        "loss": "loss value, when known",
        "state_digest": "a digest of the rank's model and optimizer state after the step, "
        "when the application gives one (the demo's: equal on every rank of its "
        "data-parallel job)",
    },
}
