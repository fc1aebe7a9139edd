"""submitit's names under ``nvrx.submit``: ``max_num_timeout`` and the warning signal.

The SLURM submissions here go through submitit for real (pickles, sbatch script)
up to the ``sbatch`` command, which is replaced by ``echo``: the script submitit
would hand to SLURM is read back from the job folder, with the job's environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from submitit.core.utils import DelayedSubmission
from submitit.slurm.slurm import SlurmExecutor

from nvrx.submission import submit as submit_module
from nvrx.submission.conventions import merge_aliases, warning_signal_name
from nvrx.submission.submit import Executor, SubmitError

SIGNAL_VARS = ("SUBMITIT_PREEMPT_SIGNAL", "NVRX_PREEMPT_SIGNAL")


def _noop() -> int:
    return 0


@pytest.fixture
def fake_slurm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """submitit's SLURM executor without SLURM: job ids 4242, 4243...; no warning signal set."""
    for name in SIGNAL_VARS:
        monkeypatch.delenv(name, raising=False)
    ids = [4242]

    def sbatch(self: SlurmExecutor, path: Path) -> list[str]:
        ids.append(ids[-1] + 1)
        return ["echo", f"Submitted batch job {ids[-2]}"]

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", sbatch)
    monkeypatch.setattr(submit_module, "slurm_partitions", lambda: {"debug": 4})
    return ids


def _submitted(folder: Path, job_id: str) -> tuple[str, dict[str, str]]:
    """The sbatch script of a job and the environment its nodes' supervisors get."""
    script = (folder / job_id / f"{job_id}_submission.sh").read_text()
    delayed = DelayedSubmission.load(folder / job_id / f"{job_id}_submitted.pkl")
    (spec,) = delayed.args
    return script, spec.env


@pytest.mark.parametrize("alias", ["max_num_timeout", "slurm_max_num_timeout"])
def test_max_num_timeout_is_max_time_limit_requeues(
    tmp_path: Path, fake_slurm: list[int], alias: str
) -> None:
    executor = Executor(tmp_path, cluster="slurm", timeout_min=10, **{alias: 5})
    assert executor._nvrx["max_time_limit_requeues"] == 5
    job = executor.submit(_noop)
    _, env = _submitted(tmp_path, job.job_id)
    assert env["NVRX_MAX_TIME_LIMIT_REQUEUES"] == "5"  # what node 0's decider caps requeues at
    executor.update_parameters(**{alias: 1})
    assert executor._nvrx["max_time_limit_requeues"] == 1
    executor.update_parameters(max_time_limit_requeues=2, **{alias: 2})  # the same value: fine
    one_setting = rf"max_time_limit_requeues=4 and {alias}=2 are one setting"
    with pytest.raises(SubmitError, match=one_setting):
        executor.update_parameters(max_time_limit_requeues=4, **{alias: 2})
    with pytest.raises(SubmitError, match=r"max_time_limit_requeues must be .* >= 0, got -1"):
        executor.update_parameters(**{alias: -1})  # checked like nvrx's own name
    assert executor._nvrx["max_time_limit_requeues"] == 2  # refused updates changed nothing


def test_three_names_of_one_setting_are_all_named() -> None:
    with pytest.raises(
        SubmitError,
        match=r"max_time_limit_requeues=1, max_num_timeout=1 and slurm_max_num_timeout=3 are one",
    ):
        merge_aliases(
            {"max_time_limit_requeues": 1, "max_num_timeout": 1, "slurm_max_num_timeout": 3}
        )
    assert merge_aliases({"slurm_signal_delay_s": 30, "nodes": 2}) == {
        "signal_delay_s": 30,
        "nodes": 2,
    }


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "USR2"),
        ({"SUBMITIT_PREEMPT_SIGNAL": "USR1"}, "USR1"),
        ({"NVRX_PREEMPT_SIGNAL": "USR1"}, "USR1"),
        ({"NVRX_PREEMPT_SIGNAL": "SIGUSR1", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}, "USR1"),
    ],
)
def test_warning_signal_from_either_variable(
    tmp_path: Path, fake_slurm: list[int], monkeypatch: pytest.MonkeyPatch, env: dict, expected: str
) -> None:
    """What SLURM is asked for (--signal in the sbatch script) and what the supervisors take as
    the warning (NVRX_PREEMPT_SIGNAL in the job) are the same signal."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    job = Executor(tmp_path, cluster="slurm", timeout_min=10, signal_delay_s=120).submit(_noop)
    script, job_env = _submitted(tmp_path, job.job_id)
    assert f"#SBATCH --signal={expected}@120\n" in script
    assert script.count("--signal=") == 1
    assert "#SBATCH --requeue\n" in script
    assert job_env["NVRX_PREEMPT_SIGNAL"] == expected
    assert job_env["NVRX_SIGNAL_DELAY_S"] == "120"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SUBMITIT_PREEMPT_SIGNAL": "USR1", "NVRX_PREEMPT_SIGNAL": "USR2"},
            r"NVRX_PREEMPT_SIGNAL='USR2' and SUBMITIT_PREEMPT_SIGNAL='USR1' are one setting",
        ),
        ({"SUBMITIT_PREEMPT_SIGNAL": "BOGUS"}, r"SUBMITIT_PREEMPT_SIGNAL='BOGUS' is not a signal"),
        ({"SUBMITIT_PREEMPT_SIGNAL": "SIGUSR1"}, r"write it without SIG"),  # submitit adds SIG
        ({"NVRX_PREEMPT_SIGNAL": "NOPE"}, r"NVRX_PREEMPT_SIGNAL='NOPE' is not a signal name"),
        ({"SUBMITIT_PREEMPT_SIGNAL": "ALRM"}, r"take USR1 or USR2 as the warning signal"),
    ],
)
def test_bad_or_conflicting_signals_fail_before_sbatch(
    tmp_path: Path, fake_slurm: list[int], monkeypatch: pytest.MonkeyPatch, env: dict, message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SubmitError, match=message):
        Executor(tmp_path, cluster="slurm", timeout_min=10).submit(_noop)
    assert not list(tmp_path.glob("**/*_submission.sh")) and not (tmp_path / "specs").exists()
    assert fake_slurm == [4242]  # sbatch never ran


def test_a_signal_in_slurm_additional_parameters_must_agree(
    tmp_path: Path, fake_slurm: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    executor = Executor(
        tmp_path,
        cluster="slurm",
        timeout_min=10,
        slurm_signal_delay_s=60,
        slurm_additional_parameters={"signal": "B:USR1@60"},
    )
    with pytest.raises(SubmitError, match=r"\['signal'\]='B:USR1@60' differs .*'USR1@60'"):
        executor.submit(_noop)
    executor.update_parameters(slurm_additional_parameters={"signal": "USR1@60", "comment": "x"})
    script, _ = _submitted(tmp_path, executor.submit(_noop).job_id)
    assert "#SBATCH --signal=USR1@60\n" in script and "#SBATCH --comment=x\n" in script


def test_signal_name_is_read_at_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NVRX_PREEMPT_SIGNAL", raising=False)
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert warning_signal_name(os.environ) == "USR1"
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL")
    assert warning_signal_name(os.environ) == "USR2"


def test_map_array_is_one_slurm_array(tmp_path: Path, fake_slurm: list[int]) -> None:
    """One sbatch of an array; each element its own spec, job id <array>_<index> and log dir."""
    executor = Executor(tmp_path, cluster="slurm", timeout_min=10, nproc_per_node=2)
    jobs = executor.map_array(divmod, [7, 9, 11], [2, 4, 5, 6])  # as zip: the shortest wins
    assert fake_slurm == [4242, 4243]  # one sbatch
    assert [j.job_id for j in jobs] == ["4242_0", "4242_1", "4242_2"]
    assert [j.log_dir for j in jobs] == [tmp_path / "nvrx_logs" / f"4242_{i}" for i in range(3)]
    assert [j.folder for j in jobs] == [tmp_path / f"4242_{i}" for i in range(3)]
    script = (tmp_path / "4242" / "4242_submission.sh").read_text()  # the array's one script
    assert "#SBATCH --array=0-2%3\n" in script and "#SBATCH --signal=USR2@90\n" in script
    from nvrx.submission.call_spec import load_spec

    calls = []
    for i in range(3):
        delayed = DelayedSubmission.load(tmp_path / f"4242_{i}" / f"4242_{i}_submitted.pkl")
        (spec,) = delayed.args
        assert spec.nproc_per_node == 2
        fn, args, kwargs = load_spec(spec.command[-1])
        calls.append(fn(*args, **kwargs))
    assert calls == [(3, 1), (2, 1), (2, 1)]
    assert executor.map_array(divmod, []) == []
    with pytest.raises(SubmitError, match="map_array needs a callable, got 3"):
        executor.map_array(3, [1])  # type: ignore[arg-type]


def test_submitits_warning_reaches_the_supervisor_as_nvrxs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """submitit's local executor warns with its own signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL):
    the node task relays it to the supervisor as the signal the supervisor waits for (USR1)."""
    import signal
    import sys
    import threading

    from nvrx.submission.node_task import _supervise
    from tests.support.waiting import wait_until

    ready, got = tmp_path / "ready", tmp_path / "got"
    supervisor = (
        "import signal, sys, pathlib\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (pathlib.Path(sys.argv[2]).write_text(str(s)),"
        " sys.exit(0)))\n"
        "pathlib.Path(sys.argv[1]).touch()\n"
        "signal.alarm(30)\n"  # never relayed: it ends, and the test fails instead of hanging
        "while True: signal.pause()\n"
    )
    env = {**os.environ, "NVRX_PREEMPT_SIGNAL": "USR1"}
    before = signal.getsignal(signal.SIGUSR2)

    def relaying() -> bool:  # the stand-in started, and the node task relays USR2
        return ready.exists() and signal.getsignal(signal.SIGUSR2) is not before

    def warn() -> None:
        wait_until("the stand-in supervisor to start", relaying, 30, interval=0.02)
        os.kill(os.getpid(), signal.SIGUSR2)

    thread = threading.Thread(target=warn)
    thread.start()
    argv = [sys.executable, "-c", supervisor, str(ready), str(got)]
    rc = _supervise(argv, env, signal.SIGUSR1, signal.SIGUSR2)
    thread.join(30)
    assert rc == 0 and got.read_text() == str(int(signal.SIGUSR1))
    assert signal.getsignal(signal.SIGUSR2) is before  # restored


def test_map_array_with_an_unpicklable_element_submits_nothing(
    tmp_path: Path, fake_slurm: list[int]
) -> None:
    import threading

    executor = Executor(tmp_path, cluster="slurm", timeout_min=10)
    with pytest.raises(SubmitError, match="cannot pickle"):
        executor.map_array(divmod, [1, threading.Lock()], [1, 1])
    assert fake_slurm == [4242] and not list((tmp_path / "specs").iterdir())


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"slurm_tasks_per_node": 4}, r"slurm_tasks_per_node must be 1 .* got 4"),
        ({"slurm_ntasks_per_node": 4}, r"slurm_ntasks_per_node must be 1 .* got 4"),
        ({"ntasks_per_node": 4}, r"ntasks_per_node must be 1 .* got 4"),  # submitit: slurm_...
        ({"slurm_nodes": 8}, r"slurm_nodes=8 but the largest partition has only 4 node\(s\)"),
        ({"slurm_nodes": 0}, r"slurm_nodes must be at least 1, got 0"),
        ({"slurm_time": "UNLIMITED"}, r"slurm_time='UNLIMITED' is not a SLURM time limit"),
        (
            {"slurm_time": "1:00:00", "signal_delay_s": 3600},
            r"signal_delay_s=3600 must be below the time limit slurm_time=60 \(3600 s\)",
        ),
        (
            {"timeout_min": 60, "slurm_time": "2:00:00"},
            r"timeout_min=60 and slurm_time=120 are one setting",
        ),
        (
            {"slurm_time": 10, "signal_delay_s": 900},
            r"signal_delay_s=900 must be below the time limit slurm_time=10 \(600 s\)",
        ),
        ({"time": 1, "signal_delay_s": 60}, r"signal_delay_s=60 must be below the time limit time=1"),
        (
            {"slurm_timeout_min": 1, "signal_delay_s": 60},
            r"below the time limit slurm_timeout_min=1",
        ),
        ({"nodes": 1, "slurm_nodes": 2}, r"nodes=1 and slurm_nodes=2 are one setting"),
        ({"slurm_use_srun": False, "nodes": 2}, r"slurm_use_srun=False: nvrx needs srun"),
        ({"use_srun": False}, r"slurm_use_srun=False: nvrx needs srun"),
        (
            {"slurm_additional_parameters": {"ntasks_per_node": 4}},
            r"slurm_additional_parameters\['ntasks_per_node'\] sets what nvrx sets: use nproc_per_node",
        ),
        (
            {"slurm_additional_parameters": {"ntasks-per-node": 4}},
            r"\['ntasks-per-node'\] sets what nvrx sets: use nproc_per_node",
        ),
        ({"additional_parameters": {"nodes": 3}}, r"\['nodes'\] sets what nvrx sets: use nodes"),
        ({"slurm_additional_parameters": {"ntasks": 8}}, r"\['ntasks'\] .* use nodes and nproc"),
        (
            {"slurm_additional_parameters": {"time": "0:01:00"}, "signal_delay_s": 60},
            r"below the time limit slurm_additional_parameters\['time'\]=1 \(60 s\)",
        ),
    ],
)
def test_submitits_cluster_names_are_checked_as_nvrxs(
    tmp_path: Path, fake_slurm: list[int], params: dict, message: str
) -> None:
    """submitit's SLURM names of nodes, tasks per node and the time limit (which win over the
    generic ones there), and the sbatch options behind them, are checked like nvrx's names:
    before, each was written into the sbatch script unchecked (4 supervisors per node, more
    nodes than the partition, a warning after the limit, no srun on the other nodes)."""
    with pytest.raises(SubmitError, match=message):
        Executor(tmp_path, cluster="slurm", **params).submit(_noop)
    assert fake_slurm == [4242] and not (tmp_path / "specs").exists()  # sbatch never ran


@pytest.mark.parametrize(
    ("params", "written"),
    [
        ({"slurm_time": "2:00:00"}, 120),
        ({"slurm_time": "1-00:00:00"}, 1440),
        ({"time": "1-02"}, 1560),
        ({"slurm_time": "90"}, 90),
        ({"slurm_time": "1:30", "signal_delay_s": 100}, 2),  # seconds round up, as SLURM's
        ({"slurm_additional_parameters": {"time": "2:00:00", "gres": "gpu:8"}}, 120),
        ({"timeout_min": 120, "slurm_time": "2:00:00"}, 120),
        ({"slurm_time": None, "timeout_min": 30, "slurm_use_srun": None}, 30),
        ({"slurm_nodes": None, "slurm_signal_delay_s": None, "slurm_ntasks_per_node": None}, 5),
    ],
)
def test_slurm_time_limits_and_unset_parameters_are_accepted(
    tmp_path: Path, fake_slurm: list[int], params: dict, written: int
) -> None:
    """sbatch's time formats in slurm_time or slurm_additional_parameters['time'] are a time
    limit, checked against signal_delay_s and written in whole minutes; a parameter given None
    is not set, as submitit takes it. Before: a time given as text was refused ("must be an
    integer"), the additional time too, so no D-HH:MM:SS limit could be given; None refused."""
    job = Executor(tmp_path, cluster="slurm", **params).submit(_noop)
    script, _ = _submitted(tmp_path, job.job_id)
    assert f"#SBATCH --time={written}\n" in script and script.count("--time") == 1
    assert "#SBATCH --nodes=1\n" in script and "#SBATCH --ntasks-per-node=1\n" in script


def test_slurm_nodes_is_the_job_handles_nodes(tmp_path: Path, fake_slurm: list[int]) -> None:
    """slurm_nodes=2 asks SLURM for 2 nodes, and the handle returns the ranks of both (before:
    it counted 1 node and dropped node 1's ranks)."""
    job = Executor(tmp_path, cluster="slurm", slurm_nodes=2, nproc_per_node=2, slurm_time=30).submit(
        _noop
    )
    script, _ = _submitted(tmp_path, job.job_id)
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=1\n" in script
    assert "#SBATCH --time=30\n" in script
    assert job.nodes == 2

    class TwoNodes:  # what submitit's Job gives for the two node tasks
        job_id = job.job_id

        def done(self) -> bool:
            return True

        def results(self) -> list[dict]:
            return [{"results": {0: "r0", 1: "r1"}}, {"results": {2: "r2", 3: "r3"}}]

    job.job, job.cluster = TwoNodes(), "local"  # no sacct to wait for
    assert job.results() == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"local_nodes": 2}, r"local_nodes=2 needs SLURM"),
        ({"local_tasks_per_node": 2}, r"local_tasks_per_node must be 1"),
        ({"local_timeout_min": 1, "signal_delay_s": 60}, r"time limit local_timeout_min=1"),
    ],
)
def test_local_names_are_checked_too(tmp_path: Path, params: dict, message: str) -> None:
    with pytest.raises(SubmitError, match=message):
        Executor(tmp_path, cluster="local", **params)


def _train(target: str = "loss", self: object = None) -> tuple:
    return target, self


def test_a_callables_keywords_may_be_named_target_or_self(
    tmp_path: Path, fake_slurm: list[int]
) -> None:
    """Before: Executor.submit(self, target, ...) took them for its own parameters
    ("got multiple values for argument 'target'")."""
    from nvrx.submission.call_spec import load_spec
    from nvrx.submission.submit import submit

    def call_of(job_id: str) -> tuple:
        delayed = DelayedSubmission.load(tmp_path / job_id / f"{job_id}_submitted.pkl")
        (spec,) = delayed.args
        fn, args, kwargs = load_spec(spec.command[-1])
        return fn(*args, **kwargs)

    executor = Executor(tmp_path, cluster="slurm", timeout_min=10)
    job = executor.submit(_train, target="accuracy", self=1)
    assert call_of(job.job_id) == ("accuracy", 1)
    job = submit(_train, kwargs={"target": "f1", "self": 2}, folder=tmp_path, cluster="slurm")
    assert call_of(job.job_id) == ("f1", 2)
    # nvrx.submit's own keywords are its keywords (its callable's go in kwargs): target= too.
    # Before: target was positional-only there as well, and nvrx.submit(target=f) failed.
    job = submit(target=_train, kwargs={"self": 3}, folder=tmp_path, cluster="slurm")
    assert call_of(job.job_id) == ("loss", 3)


def test_a_failed_sbatch_leaves_no_spec(
    tmp_path: Path, fake_slurm: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the pickled call stayed in specs/ for a job that never existed."""
    monkeypatch.setattr(SlurmExecutor, "_make_submission_command", lambda self, path: ["false"])
    executor = Executor(tmp_path, cluster="slurm", timeout_min=10)
    from submitit.core.utils import FailedJobError

    with pytest.raises(FailedJobError):  # submitit's word for sbatch's failure, as it was
        executor.submit(_noop)
    with pytest.raises(FailedJobError):
        executor.map_array(divmod, [1, 2], [3, 4])
    assert not list((tmp_path / "specs").iterdir())
