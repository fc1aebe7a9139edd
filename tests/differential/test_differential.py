"""nvrx against NVRx 0.4.1 itself: each scenario of ``scenarios/`` runs under both, the outcomes must match.

A difference is either fixed in nvrx, or deliberate: then a test here asserts it (so it
cannot drift) and the compatibility table of docs/inprocess.md or docs/fault_tolerance.md
gives the reason. A difference whose fix is pending is a strict ``xfail`` naming where
the fix belongs. Durations never count: computed timeouts are compared as "set or not".
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from differential_harness import differences

pytestmark = pytest.mark.differential

WORLD = 2
#: Wrapper cases of scenarios/wrapper_rounds.py (its docstring says what each does).
CASES = [
    "fault_initialize",
    "fault_abort+completion",
    "fault_finalize",
    "fault_health_check",
    "fault_terminate",
    "hot_spare",
    "dist_initialized",
    "local_store_class",
    "nested_restarter",
    "nested_restarter_abort",
    "hang_protection_off",
    "rank_filter_logfile",
    "health_check_compose",
    "keyboard_interrupt",
    "ping_timeout",
    "call_arguments",
]


def _same(reference: Any, nvrx: Any, what: str) -> None:
    found = differences(reference, nvrx)
    assert not found, f"{what} differs from the reference:\n" + "\n".join(found)


def _caught_alike(reference: Any, nvrx: Any) -> bool:
    """Both raised, and every ``except`` clause that catches the reference's catches nvrx's."""
    return set(reference["catchable_as"]) <= set(nvrx["catchable_as"])


# -- rank assignment: the mapping of each class on synthetic inputs -------------------------


def test_rank_assignment_mappings_match(scenario):
    runs = scenario("rank_assignments.py")
    ref, ours = runs["reference"][0], runs["nvrx"][0]
    for part in ("rank_filters", "grouped", "trees"):
        _same(ref[part], ours[part], part)
    for name, ranks in ours["trees"].items():  # the cases of several rounds ran all of them
        if name.endswith("; rounds)"):
            assert any(len(seen) > 2 and "state" in seen[-1] for seen in ranks), (name, ranks)
    fill_gaps = {k for k in ref["renumberings"] if "FillGaps" in k}
    _same(
        {k: v for k, v in ref["renumberings"].items() if k not in fill_gaps},
        {k: v for k, v in ours["renumberings"].items() if k not in fill_gaps},
        "renumberings",
    )


def test_fill_gaps_follows_the_references_documented_mapping_not_its_code(scenario):
    """Deliberate: the reference's code moves rank r >= new world size to the (r - new world
    size)-th terminated rank, which can lie past the new world (0 X 2 3 X X 6 7 gives 6->4,
    7->5 in a world of 5); nvrx fills the gaps below the new world size, as the reference's
    docstring draws it (6->1, 7->4)."""
    runs = scenario("rank_assignments.py")
    ref, ours = runs["reference"][0]["renumberings"], runs["nvrx"][0]["renumberings"]
    key = "FillGaps ws=8 terminated=[1, 4, 5] rank={}"
    assert [ref[key.format(r)]["state"]["rank"] for r in (6, 7)] == [4, 5]
    assert [ours[key.format(r)]["state"]["rank"] for r in (6, 7)] == [1, 4]
    for terminated in ("[1, 4, 5]", "[0, 7]", "[6, 7]", "[1]"):
        new_ranks = sorted(
            v["state"]["rank"] for k, v in ours.items()
            if k.startswith(f"FillGaps ws=8 terminated={terminated} ") and "state" in v
        )  # fmt: skip
        assert new_ranks == list(range(len(new_ranks))), (terminated, new_ranks)
    for k, v in ours.items():  # a gap-free input maps the same in both
        if k.startswith("FillGaps") and "terminated=[] " in k:
            assert v == ref[k], k


def test_the_references_round_store_shadows_its_own_barrier(scenario):
    """Deliberate (compatibility table, ``FilterCountGroupedByKey``): under torch >= 2.13 the
    reference's ``PrefixStore`` reaches torch's ``Store.barrier``, which refuses the
    reference's arguments; nvrx's round store runs its own barrier."""
    runs = scenario("rank_assignments.py")
    assert runs["reference"][0]["prefix_store_barrier"] == {"raised": "TypeError"}
    assert runs["nvrx"][0]["prefix_store_barrier"] == {"raised": None}


# -- Wrapper parameters: defaults and refused values, no call ---------------------------


#: Parameters of nvrx's Wrapper that the reference's has not (``docs/inprocess.md``).
NVRX_ONLY_PARAMETERS = ["monitor_process_pidfile", "rejoin_timeout"]


def test_wrapper_parameters_match(scenario):
    runs = scenario("wrapper_params.py")
    ref, ours = copy.deepcopy(runs["reference"][0]), copy.deepcopy(runs["nvrx"][0])
    ref["refused"].pop("seconds_as_float"), ours["refused"].pop("seconds_as_float")
    ref["compose"].pop("empty"), ours["compose"].pop("empty")
    ref.pop("plugins"), ours.pop("plugins")  # deliberate, asserted below
    ref.pop("reachable_submodules"), ours.pop("reachable_submodules")  # compared below
    # every parameter of the reference's Wrapper is given a value other than its default
    assert ref.pop("left_default") == [], "a reference parameter left at its default"
    assert ours.pop("left_default") == NVRX_ONLY_PARAMETERS
    _same(ref, ours, "Wrapper(...)")


def test_wrapper_takes_seconds_as_numbers(scenario):
    """Deliberate: nvrx's Wrapper also takes its intervals and timeouts as seconds (a number);
    the reference accepts only timedelta (TypeError). Code written for the reference passes
    timedeltas, which both take alike."""
    runs = scenario("wrapper_params.py")
    assert runs["reference"][0]["refused"]["seconds_as_float"]["raised"][0] == "TypeError"
    assert runs["nvrx"][0]["refused"]["seconds_as_float"]["soft_timeout"] == ["timedelta", 5.0]


def test_an_empty_composition_is_refused_by_name(scenario):
    """Deliberate: ``Compose()`` with nothing to compose raises ``ValueError`` saying so; the
    reference raises ``IndexError`` (it indexes its empty tuple of steps)."""
    runs = scenario("wrapper_params.py")
    assert runs["reference"][0]["compose"]["empty"]["raised"][0] == "IndexError"
    assert runs["nvrx"][0]["compose"]["empty"]["raised"][0] == "ValueError"


def test_the_submodules_are_reachable_from_the_package(scenario):
    """NVRx's guides write ``inprocess.abort.AbortTorchDistributed()`` after importing only the
    package: every submodule the reference's package reaches so, nvrx's reaches too, but the
    sibling monitor (internal: compatibility table)."""
    runs = scenario("wrapper_params.py")
    ref, ours = runs["reference"][0]["reachable_submodules"], runs["nvrx"][0]["reachable_submodules"]
    assert {"abort", "store", "health_check", "rank_assignment"} <= set(ref), ref
    missing = set(ref) - set(ours) - {"sibling_monitor"}
    assert not missing, f"nvrx.inprocess does not reach {sorted(missing)}"


def test_threaded_finalize_runs_without_cuda(scenario):
    """Deliberate (compatibility table, ``ThreadedFinalize``): the reference refuses to run
    it on a host without CUDA (``RuntimeError`` in ``finalize``, which ends the rank); nvrx
    runs the function in its thread with the arguments given."""
    runs = scenario("wrapper_params.py")
    ref, ours = runs["reference"][0]["plugins"], runs["nvrx"][0]["plugins"]
    assert ref["threaded_finalize"] == {"returned": {"raised": ["RuntimeError", "Exception", "BaseException", "object"]}, "fn_called_with": []}
    assert ours["threaded_finalize"] == {"returned": "FrozenState", "fn_called_with": [[1, 2]]}


def test_a_spare_has_no_rank_in_its_environment(scenario):
    """Deliberate (compatibility table, ``State.set_distributed_vars``): a spare's ``RANK``
    is removed; the reference sets the string ``'None'``, which ``int()`` refuses."""
    runs = scenario("wrapper_params.py")
    ref, ours = runs["reference"][0]["plugins"], runs["nvrx"][0]["plugins"]
    assert ref["spare_environment"] == {"RANK": "None", "WORLD_SIZE": "1"}
    assert ours["spare_environment"] == {"RANK": None, "WORLD_SIZE": "1"}


def test_compositions_run_as_the_guides_say(scenario):
    """The comparison above holds only if the composition ran: the last step runs first."""
    runs = scenario("wrapper_params.py")
    for impl in runs:
        assert runs[impl][0]["compose"]["order"] == ["c", "b", "a"], impl
        assert all(runs[impl][0]["compose"]["wrapper_takes"].values()), impl


# -- fault_tolerance: configuration and client --------------------------------------------

HB_DEFAULTS = ("initial_rank_heartbeat_timeout", "rank_heartbeat_timeout")


def _without_hb_defaults(config: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(config)
    for part in ("defaults", "from_kwargs", "from_yaml_nested"):
        if isinstance(config[part], dict) and "raised" not in config[part]:
            for name in HB_DEFAULTS:
                if part == "from_yaml_nested" and name == "rank_heartbeat_timeout":
                    continue  # set by the file
                config[part].pop(name, None)
    return config


def _exceptions_alike(reference: dict[str, Any], nvrx: dict[str, Any], path: str = "") -> None:
    """Outcomes equal, where an exception of nvrx may be a subclass the reference's
    ``except`` clauses catch."""
    for key in sorted(set(reference) | set(nvrx)):
        a, b = reference.get(key, "<absent>"), nvrx.get(key, "<absent>")
        where = f"{path}.{key}" if path else key
        if isinstance(a, dict) and "raised" in a and isinstance(b, dict) and "raised" in b:
            assert _caught_alike(a, b), f"{where}: reference raised {a}, nvrx {b}"
        elif isinstance(a, dict) and isinstance(b, dict):
            _exceptions_alike(a, b, where)
        else:
            _same(a, b, where)


def test_fault_tolerance_config_matches(scenario):
    runs = scenario("ft_client.py")
    ref, ours = runs["reference"][0]["config"], runs["nvrx"][0]["config"]
    assert set(ref["fields"]) <= set(ours["fields"]), set(ref["fields"]) - set(ours["fields"])
    ref, ours = _without_hb_defaults(ref), _without_hb_defaults(ours)
    ref.pop("fields"), ours.pop("fields")
    _exceptions_alike(ref, ours)


def test_heartbeat_timeouts_are_unchecked_by_default(scenario):
    """Deliberate: the reference's defaults end a rank after 3600 s without a first heartbeat
    and 2700 s between two, even one that only uses sections; nvrx checks only what is set."""
    runs = scenario("ft_client.py")
    ref, ours = runs["reference"][0]["config"], runs["nvrx"][0]["config"]
    assert [ref["defaults"][n] for n in HB_DEFAULTS] == [3600.0, 2700.0]
    assert [ours["defaults"][n] for n in HB_DEFAULTS] == [None, None]


def test_every_public_name_of_the_reference_exists(scenario):
    """Every public attribute and method of the reference's client, configuration and
    workload-control types exists in nvrx (nvrx may have more)."""
    runs = scenario("ft_client.py")
    ref, ours = runs["reference"][0]["public"], runs["nvrx"][0]["public"]
    # the reference's client internals: its connection, calculator and loaded state
    internal = {
        "chkpt_manager", "iter_idx", "launcher_connector", "loaded_hb_timeouts",
        "loaded_section_timeouts", "rank_info", "rank_monitor_socket", "timeouts_calc", "logger",
    }  # fmt: skip
    missing = set(ref["RankMonitorClient"]) - set(ours["RankMonitorClient"]) - internal
    assert not missing, f"RankMonitorClient lacks {sorted(missing)}"
    missing = set(ref["FaultToleranceConfig"]) - set(ours["FaultToleranceConfig"])
    assert not missing, f"FaultToleranceConfig lacks {sorted(missing)}"
    assert ref["WorkloadAction"] == ours["WorkloadAction"]
    assert ref["WorkloadControlRequest"] == ours["WorkloadControlRequest"]


def test_rank_monitor_client_matches(scenario):
    runs = scenario("ft_client.py")
    ref, ours = copy.deepcopy(runs["reference"][0]), copy.deepcopy(runs["nvrx"][0])
    for record in (ref, ours):
        record.pop("config"), record.pop("loaded"), record.pop("public")
        for deliberate in ("state_dict", "load_unknown_mapping"):
            record["before_init"].pop(deliberate)
        steps = record["monitored"]
        for deliberate in ("calc_without_process_group", "unknown_section", "checkpoint"):
            steps.pop(deliberate)
    _exceptions_alike(ref, ours)


def test_client_deliberate_differences(scenario):
    """Deliberate: nvrx computes timeouts from this rank's observations when torch.distributed
    is not initialized (the reference raises), and takes a section that has no configured
    timeout (unchecked, but it counts as in a section; the reference refuses it)."""
    runs = scenario("ft_client.py")
    ref, ours = runs["reference"][0]["monitored"], runs["nvrx"][0]["monitored"]
    assert ref["calc_without_process_group"]["raised"] == "TimeoutsCalcError"
    assert ours["calc_without_process_group"] is False  # not ready: no heartbeat yet
    assert ref["unknown_section"]["raised"] == "RankMonitorClientError"
    assert ours["unknown_section"] is None


def test_client_checkpoint_deliberate_differences(scenario):
    """Deliberate: ``state_dict()`` before monitoring starts returns the empty checkpoint entry
    (the reference fails on its unset timeouts), and ``load_state_dict`` refuses a mapping
    that is no checkpoint entry (the reference ignores it: a wrong key passes unnoticed)."""
    runs = scenario("ft_client.py")
    ref, ours = runs["reference"][0]["before_init"], runs["nvrx"][0]["before_init"]
    assert ref["state_dict"]["raised"] == "AttributeError"
    assert ours["state_dict"] == {"current_timeouts": {}}
    assert ref["load_unknown_mapping"] is None
    assert ours["load_unknown_mapping"]["raised"] == "RankMonitorClientError"


def test_a_checkpoint_of_either_implementation_loads_in_both(scenario, tmp_path):
    written = scenario("ft_client.py")
    paths = []
    for impl in ("reference", "nvrx"):
        path = tmp_path / f"{impl}-checkpoint.json"
        path.write_text(json.dumps(written[impl][0]["monitored"]["checkpoint"]))
        paths.append(str(path))
    assert written["reference"][0]["monitored"]["checkpoint_shape"] == written["nvrx"][0]["monitored"]["checkpoint_shape"]
    runs = scenario("ft_client.py", "load:" + ",".join(paths))
    ref, ours = runs["reference"][0]["loaded"], runs["nvrx"][0]["loaded"]
    assert len(ref) == len(ours) == 2
    for i, writer in enumerate(("reference", "nvrx")):
        assert ref[i]["section_timeouts"] is not None, f"the reference did not load {writer}'s"
        _exceptions_alike(ref[i], ours[i], f"checkpoint of {writer}")


# -- the Wrapper: 2 ranks, a fault in the function or a hook ------------------------------


def _round_of(entry: list[Any]) -> int:
    """The round of a journal entry: ``["fn", it]``, or a hook's state (its ``iteration``)."""
    what, data = entry
    if what == "fn":
        return data
    if what == "rank_assignment":
        data = data["in"]
    return data["iteration"] if isinstance(data, dict) and "iteration" in data else 0


def _normalized(record: dict[str, Any]) -> dict[str, Any]:
    """The parts of a rank's record that must match, with the reference's timing-dependent
    abort of the last round (it races the rank's exit) and the deliberate ``mode`` of the
    state given to ``terminate`` taken out."""
    journal = copy.deepcopy(record["journal"])
    last = max((_round_of(e) for e in journal), default=0)  # the round the rank left in
    if record["raised"] is not None:
        journal = [e for e in journal if not (e[0] == "abort" and e[1]["iteration"] >= last)]
    for entry in journal:
        if entry[0] == "terminate":
            entry[1].pop("mode")
    raised = record["raised"]
    return {
        "journal": journal,
        "rounds": record["rounds"],
        "returned": record["returned"],
        "raised": None if raised is None else raised["type"],
        "leftovers": {k: record["leftovers"][k] for k in ("threads", "stores")},
    }


@pytest.mark.parametrize("case", [*CASES, "should_restart"])
def test_wrapper_outcome_matches(scenario, case):
    # should_restart once stalled 60 s in nvrx before its restart: under that, a stall fails
    runs = scenario("wrapper_rounds.py", case, WORLD, timeout=55.0 if case == "should_restart" else 90.0)
    for rank in range(WORLD):
        _same(_normalized(runs["reference"][rank]), _normalized(runs["nvrx"][rank]), f"{case} rank {rank}")
        ref_exc, our_exc = runs["reference"][rank]["raised"], runs["nvrx"][rank]["raised"]
        if ref_exc is not None and ref_exc["type"] == "RestartAbort":
            assert our_exc["message"].startswith(ref_exc["message"]), (ref_exc, our_exc)


@pytest.mark.parametrize("case", CASES)
def test_wrapper_exception_has_the_same_direct_cause(scenario, case):
    runs = scenario("wrapper_rounds.py", case, WORLD)
    for rank in range(WORLD):
        ref_exc, our_exc = runs["reference"][rank]["raised"], runs["nvrx"][rank]["raised"]
        if ref_exc is not None and our_exc is not None:
            assert ref_exc["causes"][:1] == our_exc["causes"][:1], (rank, ref_exc, our_exc)


def test_terminate_is_told_the_rank_is_terminated(scenario):
    """Deliberate: ``terminate`` gets the leaving rank's state with mode TERMINATED; the
    reference passes the mode of its last round (ACTIVE)."""
    runs = scenario("wrapper_rounds.py", "fault_terminate", WORLD)
    for rank in range(WORLD):
        modes = {
            impl: [e[1]["mode"] for e in runs[impl][rank]["journal"] if e[0] == "terminate"]
            for impl in runs
        }
        assert modes == {"reference": ["ACTIVE"], "nvrx": ["TERMINATED"]}, modes


def test_the_wrapper_logs_under_its_own_package_name(scenario):
    """Deliberate: nvrx's Wrapper logs under ``nvrx.inprocess``, the reference under
    ``nvidia_resiliency_ext.inprocess``; the logger name changes with the import."""
    runs = scenario("wrapper_rounds.py", "fault_initialize", WORLD)
    assert runs["reference"][1]["reference_name_levels"]
    assert runs["nvrx"][1]["reference_name_levels"] == []


@pytest.mark.parametrize("case", CASES)
def test_the_wrapper_leaves_no_logging_handler(scenario, case):
    runs = scenario("wrapper_rounds.py", case, WORLD)
    for rank in range(WORLD):
        assert runs["reference"][rank]["leftovers"]["handlers_added"] == []
        assert runs["nvrx"][rank]["leftovers"]["handlers_added"] == []


@pytest.mark.parametrize("case", CASES)
def test_no_store_object_waits_for_the_garbage_collector(scenario, case):
    runs = scenario("wrapper_rounds.py", case, WORLD)
    for rank in range(WORLD):
        counts = {impl: runs[impl][rank]["leftovers"]["stores_before_collection"] for impl in runs}
        assert counts["nvrx"] <= counts["reference"], (rank, counts)


def test_a_restart_reaches_the_users_log_handler(scenario):
    runs = scenario("wrapper_rounds.py", "fault_initialize", WORLD)
    for rank in range(WORLD):
        warned = {impl: bool({"WARNING", "ERROR", "CRITICAL"} & set(runs[impl][rank]["user_handler_levels"])) for impl in runs}
        assert warned == {"reference": True, "nvrx": True}, (rank, warned)


def _without_repeats(lines: list[str]) -> list[str]:
    """``lines`` with a line equal to the one before it left out: the reference's abort of the
    last round races the rank's exit (``_normalized``), and prints its line again when it wins."""
    return [line for i, line in enumerate(lines) if i == 0 or line != lines[i - 1]]


@pytest.mark.parametrize("case", ["nested_restarter", "nested_restarter_abort"])
def test_nested_restarter_lines_match(scenario, case):
    """The lines an outer restarter follows: the same states and stages, in the same order,
    printed by the same rank."""
    runs = scenario("wrapper_rounds.py", case, WORLD)
    for rank in range(WORLD):
        lines = {impl: _without_repeats(runs[impl][rank]["restarter_lines"]) for impl in runs}
        _same(lines["reference"], lines["nvrx"], f"{case} rank {rank} restarter lines")
    assert runs["reference"][0]["restarter_lines"], "the reference printed no restarter line"


def test_the_monitor_log_file_is_written_where_asked(scenario):
    runs = scenario("wrapper_rounds.py", "rank_filter_logfile", WORLD)
    for rank in range(WORLD):
        written = {impl: runs[impl][rank]["monitor_logfile"] for impl in runs}
        assert written == {"reference": True, "nvrx": True}, (rank, written)


def test_the_new_cases_exercise_what_they_name(scenario):
    """The cases above compare alike only if they ran their path: hang protection off
    restarts nothing after the silence, the old-style rank filter is called."""
    runs = scenario("wrapper_rounds.py", "hang_protection_off", WORLD)
    for impl in runs:
        assert [r["iteration"] for r in runs[impl][1]["rounds"]] == [0], impl
        assert runs[impl][1]["returned"] is not None, impl
    runs = scenario("wrapper_rounds.py", "rank_filter_logfile", WORLD)
    for impl in runs:
        assert [r["iteration"] for r in runs[impl][0]["rounds"]] == [0, 1], impl
        assert any(e[0] == "rank_filter" for e in runs[impl][0]["journal"]), impl


def test_the_usage_cases_exercise_what_they_name(scenario):
    """The cases taken from how NVRx is used compare alike only if they ran their path: the
    fault counter ends rank 1 after its second fault (its restart health check fails) and
    rank 0 finishes alone; a ``KeyboardInterrupt`` takes only its rank out; a manual
    heartbeat that stops restarts every rank once."""
    runs = scenario("wrapper_rounds.py", "health_check_compose", WORLD)
    for impl in runs:
        leaver, survivor = runs[impl][1], runs[impl][0]
        assert leaver["raised"]["type"] == "HealthCheckError", impl
        assert leaver["raised"]["causes"][:1] == ["FaultCounterExceeded"], impl
        assert [(r["iteration"], r["WORLD_SIZE"]) for r in survivor["rounds"]] == [(0, 2), (1, 2), (2, 1)], impl
    runs = scenario("wrapper_rounds.py", "keyboard_interrupt", WORLD)
    for impl in runs:
        assert runs[impl][1]["raised"]["type"] == "KeyboardInterrupt", impl
        assert [(r["iteration"], r["WORLD_SIZE"]) for r in runs[impl][0]["rounds"]] == [(0, 2), (1, 1)], impl
        assert runs[impl][0]["raised"] is None, impl
    runs = scenario("wrapper_rounds.py", "ping_timeout", WORLD)
    for impl in runs:
        for rank in range(WORLD):
            record = runs[impl][rank]
            assert [r["iteration"] for r in record["rounds"]] == [0, 1], (impl, rank)
            assert record["raised"] is None, (impl, rank)
            # a hang is no exception of the function: no rank's restart names one
            causes = {e[1]["fn_exception"] for e in record["journal"] if e[0] == "finalize"}
            assert causes == {None}, (impl, rank, causes)


def test_the_function_receives_its_arguments_as_in_the_reference(scenario):
    """Positional and keyword arguments reach every round as given (the same list object,
    so what a round appended is there in the next), the ``CallWrapper`` is injected through
    ``Optional[CallWrapper]``, and it has every public attribute name of the reference's.
    Its ``store`` and ``base_store`` are the call's ``TCPStore`` itself, one object every
    round, so a key set through ``store`` in round 0 is read in round 1; its ``state`` is
    the rank's ``State`` of the round, field for field; its ``wrapper`` is the ``Wrapper``,
    its ``atomic_lock`` an ``RLock``."""
    runs = scenario("wrapper_rounds.py", "call_arguments", WORLD)
    for rank in range(WORLD):
        ref, ours = runs["reference"][rank], runs["nvrx"][rank]
        assert ref["received"] == [
            {"metrics": [0], "tag": "tag", "scale": 3},
            {"metrics": [0, 1], "tag": "tag", "scale": 3},
        ], ref["received"]
        _same(ref["received"], ours["received"], f"rank {rank} arguments")
        missing = set(ref["call_wrapper"]["public"]) - set(ours["call_wrapper"]["public"])
        assert not missing, f"nvrx's CallWrapper lacks {sorted(missing)}"
        assert ref["call_wrapper"]["base_store_is_a_store"] is ours["call_wrapper"]["base_store_is_a_store"] is True
        for name, cls in (("wrapper", "Wrapper"), ("atomic_lock", "RLock")):
            assert ref["call_wrapper"][f"{name}_type"] == ours["call_wrapper"][f"{name}_type"] == cls, name
        same_store = {
            "base_store_type": "TCPStore",
            "store_type": "TCPStore",
            "store_is_base_store": True,
            "same_base_store_every_round": True,
        }
        stores = [{k: v for k, v in r.items() if not k.startswith("state")} for r in ref["store_rounds"]]
        assert stores == [
            dict(same_store, key_from_an_earlier_round=False),
            dict(same_store, key_from_an_earlier_round=True),
        ], ref["store_rounds"]
        states = [(r["state_type"], r["state"]["iteration"], r["state"]["rank"]) for r in ref["store_rounds"]]
        assert states == [("State", 0, rank), ("State", 1, rank)], states
        _same(ref["store_rounds"], ours["store_rounds"], f"rank {rank} CallWrapper.store")


def test_a_script_started_without_its_launcher_is_told_alike(scenario):
    """``init_workload_monitoring()`` and ``send_workload_control_request()`` with no rank
    monitor to reach (a script run with plain python or torchrun) raise, in both, an error
    that ``except RankMonitorClientError`` (resp. ``RuntimeError``) catches."""
    runs = scenario("ft_client.py")
    ref, ours = runs["reference"][0]["before_init"], runs["nvrx"][0]["before_init"]
    assert ref["init_without_launcher"]["raised"] == "RankMonitorClientError"
    assert ref["workload_control_without_launcher"]["raised"] == "RuntimeError"
    for step in ("init_without_launcher", "workload_control_without_launcher"):
        assert _caught_alike(ref[step], ours[step]), (step, ref[step], ours[step])


def test_the_call_wrapper_is_injected_through_a_string_annotation(scenario):
    """Deliberate (docs/inprocess.md, "Differences from the reference"): under ``from
    __future__ import annotations`` the reference fails the call with ``TypeError`` (its
    annotation check takes the string for a class); nvrx resolves the annotation and
    injects the ``CallWrapper``."""
    runs = scenario("injection.py", world_size=1)
    ref, ours = runs["reference"][0], runs["nvrx"][0]
    assert ref["raised"]["type"] == "TypeError" and ref["received"] == [], ref
    assert ours["raised"] is None and ours["received"] == ["CallWrapper"], ours
    assert ours["returned"] == 2
