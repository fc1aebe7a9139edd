"""nvrx.jobenv: the one place that knows the NVRX_* variables, their defaults and a child's environment."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from nvrx import jobenv
from nvrx.jobenv import JobEnv
from nvrx.slurm.topology import job_from_slurm
from nvrx.supervisor.cli import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def test_child_environment_follows_the_documented_contract(tmp_path: Path) -> None:
    job = JobEnv(job_id="42", log_dir=str(tmp_path), nnodes=2, node_rank=1, nproc_per_node=2,
                 master_addr="node1", master_port=20084, store_port=20085)  # fmt: skip
    base = {"KEEP": "1", "RANK": "stale", jobenv.SUPERVISOR_LOCAL_RANK: "0"}  # a monitor's
    env = job.child_env(1, restart_count=3, base=base, extra={"X": "y"})
    assert env["KEEP"] == "1" and env["X"] == "y" and jobenv.SUPERVISOR_LOCAL_RANK not in env
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
    }  # fmt: skip
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("node1", "20084")
    assert (env["NVRX_STORE_HOST"], env["NVRX_STORE_PORT"]) == ("node1", "20085")
    assert env["NVRX_LOG_DIR"] == str(tmp_path) and env["NVRX_JOB_ID"] == "42"
    assert (env["NVRX_NODE_RANK"], env["NVRX_NNODES"], env["NVRX_NPROC_PER_NODE"]) == (
        "1",
        "2",
        "2",
    )
    assert (env["NVRX_RESTART_COUNT"], env["NVRX_SUPERVISED"]) == ("3", "1")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # set where the user did not
    kept = job.child_env(1, 0, base={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert kept["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # kept where the user did
    # every NVRX_* name of the contract table in docs/conventions.md is one the child gets
    documented = set()
    for line in (
        (ROOT / "docs" / "conventions.md")
        .read_text()
        .split("## Environment contract")[1]
        .splitlines()
    ):
        if line.startswith("| `NVRX_"):
            documented.update(part.strip("` ") for part in line.split("|")[1].split(","))
    assert documented and documented <= set(env)


def test_a_child_reads_back_what_its_supervisor_wrote(tmp_path: Path) -> None:
    job = JobEnv(job_id="7", log_dir=str(tmp_path), nnodes=3, node_rank=2, nproc_per_node=4,
                 master_addr="10.0.0.1", master_port=30000, store_port=30007)  # fmt: skip
    assert JobEnv.from_env(job.child_env(0, 0, base={})) == job
    assert jobenv.job_dir(env=job.child_env(0, 0, base={})) == tmp_path / "7"


def test_defaults_without_any_variable() -> None:
    assert jobenv.job_id_from({}) == "local"
    assert jobenv.log_dir_from({}) == Path("nvrx_logs")
    job = JobEnv.local(env={})
    assert (job.master_port, job.store_port, job.job_id) == (29500, 29503, "local-29503")
    assert job.job_dir == Path.cwd() / "nvrx_logs" / "local-29503"  # absolute: children may chdir


def test_the_store_port_follows_master_port_everywhere() -> None:
    # past MASTER_PORT + 1 and + 2, the ports of NVRx's layout; never past the last port
    assert jobenv.store_port_for(29500) == 29503
    assert jobenv.store_port_for(65535) == 65532
    assert jobenv.store_port_for(65532) == 65535
    assert JobEnv.local(master_port=31000, env={}).store_port == 31003
    assert JobEnv.from_env({"MASTER_PORT": "31000"}).store_port == 31003
    slurm = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}  # fmt: skip
    assert job_from_slurm({**slurm, "MASTER_PORT": "31000"}).store_port == 31003
    derived = job_from_slurm(slurm)
    assert (derived.master_port, derived.store_port) == jobenv.ports_for_job("1234")
    assert derived.store_port == derived.master_port + jobenv.STORE_PORT_OFFSET


def test_supervisor_cli_builds_its_job_from_the_contract(tmp_path: Path) -> None:
    env = {"NVRX_LOG_DIR": str(tmp_path), "NVRX_JOB_ID": "j1"}
    config, _ = config_from_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "2",
            "--master-port",
            "25000",
            "--",
            "true",
        ],
        env,
    )
    assert config.job_env == JobEnv(job_id="j1", log_dir=str(tmp_path), nnodes=2, node_rank=1,
                                    nproc_per_node=2, master_addr="127.0.0.1",
                                    master_port=25000, store_port=25003)  # fmt: skip
    assert config.events_dir == tmp_path / "j1"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NVRX_NNODES": "two"}, "NVRX_NNODES='two' is not an integer"),
        ({"MASTER_PORT": "x"}, "MASTER_PORT='x' is not an integer"),
    ],
)
def test_malformed_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        JobEnv.from_env(env)


def test_seconds_from_rejects_negative_and_junk() -> None:
    assert jobenv.seconds_from({"NVRX_SIGNAL_DELAY_S": "90"}, jobenv.SIGNAL_DELAY_S, 0) == 90.0
    assert jobenv.seconds_from({}, jobenv.SIGNAL_DELAY_S, 5) == 5
    with pytest.raises(ValueError, match="must not be negative"):
        jobenv.seconds_from({"NVRX_SIGNAL_DELAY_S": "-1"}, jobenv.SIGNAL_DELAY_S, 0)
    with pytest.raises(ValueError, match="is not a number"):
        jobenv.seconds_from({"NVRX_SIGNAL_DELAY_S": "soon"}, jobenv.SIGNAL_DELAY_S, 0)
    for endless in ("inf", "1e400", "86401"):  # a wait that never ends, or one select refuses
        with pytest.raises(ValueError, match="must be at most 86400 seconds"):
            jobenv.seconds_from({"NVRX_PREEMPT_WINDOW_S": endless}, "NVRX_PREEMPT_WINDOW_S", 0)
    with pytest.raises(ValueError, match="'nan' is not a number"):
        jobenv.seconds_from({"NVRX_PREEMPT_WINDOW_S": "nan"}, "NVRX_PREEMPT_WINDOW_S", 0)


@pytest.mark.parametrize("raw", ["inf", "2.7", "-1", "three"])
def test_a_requeue_cap_that_is_no_whole_number_is_a_usage_error(raw: str) -> None:
    from nvrx.supervisor import preemption

    with pytest.raises(ValueError, match="NVRX_MAX_TIME_LIMIT_REQUEUES"):
        preemption.settings_from_env({"NVRX_MAX_TIME_LIMIT_REQUEUES": raw})


def _spelled_outside_jobenv(wanted: Callable[[str], bool]) -> list[str]:
    """``path:line: string`` of every string constant ``wanted`` accepts in a module of the
    package but nvrx/jobenv.py, the one that names the environment's variables."""
    spelled = []
    for path in sorted((ROOT / "nvrx").rglob("*.py")):
        if path.name == "jobenv.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and wanted(node.value):
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    return spelled


def test_only_the_contract_module_spells_the_variable_names() -> None:
    """No module but nvrx/jobenv.py has an NVRX_* name as a string: the others use its constants."""
    spelled = _spelled_outside_jobenv(lambda s: re.fullmatch(r"NVRX_[A-Z0-9_]+", s) is not None)
    assert not spelled, "\n".join(spelled)


def test_one_module_names_the_log_directory_variable() -> None:
    found = subprocess.run(
        ["grep", "-rl", "--include=*.py", "NVRX_LOG_DIR", str(ROOT / "nvrx")],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    assert [Path(f).relative_to(ROOT).as_posix() for f in found] == ["nvrx/jobenv.py"]


SLURM_STEP = {
    "SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1",
}  # fmt: skip


def test_supervisor_cli_under_slurm_keeps_the_environment_port_the_options_do_not_give(
    tmp_path: Path,
) -> None:
    env = {**SLURM_STEP, "NVRX_LOG_DIR": str(tmp_path), "NVRX_STORE_PORT": "25000"}
    config, _ = config_from_args(["--master-port", "30000", "--", "true"], env)
    assert (config.master_port, config.store_port) == (30000, 25000)
    env = {**SLURM_STEP, "NVRX_LOG_DIR": str(tmp_path), "MASTER_PORT": "30000"}
    config, _ = config_from_args(["--store-port", "25000", "--", "true"], env)
    assert (config.master_port, config.store_port) == (30000, 25000)
    config, _ = config_from_args(["--", "true"], env)
    assert (config.master_port, config.store_port) == (30000, 30003)
    assert (config.node_rank, config.nnodes, config.master_addr) == (1, 2, "n1")
    assert config.events_dir == tmp_path / "1234"  # the log dir of the env given, not os.environ
    config, _ = config_from_args(["--", "true"], {**env, "NVRX_JOB_ID": "mine"})
    assert config.job_id == "mine"


def test_a_child_gets_every_variable_torchrun_sets(tmp_path: Path) -> None:
    """The names come from torch's own agent (the worker environment it builds), so a torch
    that adds one fails this test until nvrx sets it too."""
    import torch.distributed.elastic.agent.server.local_elastic_agent as agent

    source = Path(agent.__file__).read_text()
    block = source.split("worker_env = {", 1)[1].split("}", 1)[0]
    torchrun = set(re.findall(r'"([A-Z][A-Z0-9_]+)":', block)) | {"LOCAL_RANK"}
    assert {"RANK", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE"} <= torchrun  # the parse worked
    job = JobEnv(job_id="77", log_dir=str(tmp_path), nnodes=3, node_rank=2, nproc_per_node=4,
                 master_addr="node1", master_port=20084, store_port=20085)  # fmt: skip
    env = job.child_env(1, restart_count=2, base={}, max_restarts=9)
    assert torchrun <= set(env), sorted(torchrun - set(env))
    assert {k: env[k] for k in ("RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")} == {
        "RANK": "9", "ROLE_RANK": "9", "ROLE_WORLD_SIZE": "12", "GROUP_WORLD_SIZE": "3",
    }  # fmt: skip
    assert (env["ROLE_NAME"], env["TORCHELASTIC_RUN_ID"]) == ("default", "77")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "9")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"


def test_omp_num_threads_is_1_when_ranks_share_a_node_and_nobody_set_it(tmp_path: Path) -> None:
    two = JobEnv(job_id="1", log_dir=str(tmp_path), nproc_per_node=2)
    one = JobEnv(job_id="1", log_dir=str(tmp_path), nproc_per_node=1)
    assert two.child_env(0, 0, base={})["OMP_NUM_THREADS"] == "1"
    assert two.child_env(0, 0, base={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in one.child_env(0, 0, base={})


@pytest.mark.parametrize(
    ("raw", "run"), [(None, 0), ("", 0), ("0", 0), ("3", 3), (" 3\n", 3), ("12", 12)]
)
def test_slurm_restart_count_is_the_run_of_the_slurm_job(raw: str | None, run: int) -> None:
    env = {} if raw is None else {jobenv.SLURM_RESTART_COUNT: raw}  # unset on a job's first run
    assert jobenv.slurm_restart_count(env) == run
    assert jobenv.slurm_run({"SLURM_JOB_ID": "9", **env}) == run


@pytest.mark.parametrize("raw", ["two", "-1", "1.5", "1e3", "inf", "+2", "1_0", "\u0663"])
def test_a_slurm_restart_count_that_is_not_a_count_is_refused_by_name(raw: str) -> None:
    env = {"SLURM_JOB_ID": "9", jobenv.SLURM_RESTART_COUNT: raw}
    with pytest.raises(ValueError, match=f"SLURM_RESTART_COUNT={re.escape(repr(raw))} is not a non-negative integer"):
        jobenv.slurm_restart_count(env)
    assert jobenv.slurm_run(env) is None  # the events record an unknown run, never a guess


@pytest.mark.parametrize("raw", [None, "0", "2", " 2"])
def test_every_reader_of_the_slurm_run_takes_the_same_run(
    raw: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preemption handler names its flag, the ranks look for it, the store seals and the
    failover files are kept by the one count (``jobenv.slurm_restart_count``)."""
    from nvrx import checkpoint_flag
    from nvrx.store import seal
    from nvrx.supervisor import preemption, store_failover

    env = {"SLURM_JOB_ID": "9"} if raw is None else {"SLURM_JOB_ID": "9", jobenv.SLURM_RESTART_COUNT: raw}
    monkeypatch.delenv(jobenv.SLURM_RESTART_COUNT, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = jobenv.slurm_restart_count(env)
    assert preemption.settings_from_env(env)["run_index"] == run
    assert checkpoint_flag.run_index_from_env(env) == run
    assert seal.run_of_job(env) == run
    assert store_failover.epoch_dir(Path("j"), 1) == Path("j", "failover", f"run{run}", "e1")
    assert jobenv.slurm_run(env) == run


@pytest.mark.parametrize("raw", ["two", "-1", "1.5", "inf"])
def test_a_bad_slurm_restart_count_stops_the_supervisor_and_its_seals_but_not_a_rank(
    raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``nvrx-supervise`` refuses it as it starts (else its flag and its ranks' could name two
    runs), no seal is made for it; a rank under another launcher looks for run 0's flag."""
    from nvrx import checkpoint_flag
    from nvrx.store import seal
    from nvrx.supervisor.config import ConfigError

    env = {"SLURM_JOB_ID": "9", jobenv.SLURM_RESTART_COUNT: raw}
    with pytest.raises(ConfigError, match="SLURM_RESTART_COUNT"):
        config_from_args(["--nproc-per-node", "1", "--", "true"], env=env)
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT"):
        seal.run_of_job(env)
    assert checkpoint_flag.run_index_from_env(env) == 0
    assert "SLURM_RESTART_COUNT" in caplog.text and "treating this as run 0" in caplog.text


def test_only_the_contract_module_reads_the_slurm_restart_count() -> None:
    """One reader (``jobenv.slurm_restart_count``): no other module names the variable in code."""
    spelled = _spelled_outside_jobenv(lambda s: s == "SLURM_RESTART_COUNT")
    assert not spelled, "\n".join(spelled)
