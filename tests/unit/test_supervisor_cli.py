"""Bad input to nvrx-supervise: exit code 2 and one line that names the fix."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from nvrx.supervisor.cli import config_from_args
from nvrx.supervisor.config import ConfigError


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "nvrx.supervisor.cli", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--bogus", "--", "python", "x.py"], "unrecognized arguments: --bogus"),
        (["--nproc-per-node", "0", "--", "python", "x.py"], "--nproc-per-node must be >= 1, got 0"),
        (["--nproc-per-node", "2"], "no training command"),
        (["--", "no-such-command-xyz"], "'no-such-command-xyz' not found on PATH"),
        (["--", "/nonexistent/train"], "not an executable file"),
        (
            ["--max-restarts", "lots", "--", "python"],
            "--max-restarts/--max_restarts: invalid int value: 'lots'",
        ),
        (["--nnodes", "2", "--node-rank", "5", "--", "python"], "--node-rank must be in 0..1"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, fragment) -> None:
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nvrx-supervise: error: ") and fragment in lines[0]


@pytest.mark.timeout(60)
def test_store_port_in_use_exits_2_naming_host_and_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _run(
            "--master-port",
            str(port - 1 if port > 1 else port + 1),
            "--store-port",
            str(port),
            "--",
            "true",
        )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0]


def test_help_explains_every_option() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for option in (
        "--nproc-per-node",
        "--max-restarts",
        "--loop-breaker",
        "--grace-period",
        "--log-dir",
        "--job-id",
        "--store-timeout",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--store-port",
    ):
        assert option in result.stdout
    assert "exit codes" in result.stdout


def test_local_topology_and_defaults_without_slurm(tmp_path) -> None:
    env = {"PATH": os.environ["PATH"]}
    cfg, verbose = config_from_args(
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            "30000",
            "--log-dir",
            str(tmp_path),
            "--",
            "python",
            "t.py",
        ],
        env,
    )
    assert (cfg.nnodes, cfg.node_rank, cfg.master_port, cfg.store_port) == (2, 1, 30000, 30003)
    assert cfg.job_id == "local-30003" and cfg.command == ["python", "t.py"] and not verbose


def test_explicit_topology_wins_over_slurm_variables() -> None:
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_PROCID": "0"}
    cfg, _ = config_from_args(["--nnodes", "1", "--master-port", "30010", "--", "python"], env)
    assert cfg.nnodes == 1 and cfg.job_id == "77"


def test_unknown_option_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="--frobnicate"):
        config_from_args(["--frobnicate", "--", "python"], {"PATH": os.environ["PATH"]})


@pytest.mark.parametrize(
    ("options", "env_value", "expected"),
    [
        ([], None, True),
        (["--no-warm-standby"], None, False),
        ([], "0", False),
        (["--warm-standby"], "0", True),  # the option wins over the template's variable
    ],
)
def test_warm_standby_option_and_variable(options, env_value, expected) -> None:
    env = {"PATH": os.environ["PATH"]}
    if env_value is not None:
        env["NVRX_WARM_STANDBY"] = env_value
    cfg, _ = config_from_args([*options, "--", "python", "t.py"], env)
    assert cfg.warm_standby is expected


@pytest.mark.parametrize(
    ("options", "env_value", "expected"),
    [([], None, 5.0), ([], "30", 30.0), (["--standby-wait", "0"], "30", 0.0)],
)
def test_standby_wait_option_and_variable(options, env_value, expected) -> None:
    env = {"PATH": os.environ["PATH"]}
    if env_value is not None:
        env["NVRX_STANDBY_WAIT_S"] = env_value
    cfg, _ = config_from_args([*options, "--", "python", "t.py"], env)
    assert cfg.standby_wait == expected


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "1e7"])
def test_a_standby_wait_out_of_range_is_an_error(value: str) -> None:
    env = {"PATH": os.environ["PATH"]}
    with pytest.raises(ConfigError, match=r"--standby-wait must be in 0\.\.86400 seconds, got "):
        config_from_args(["--standby-wait", value, "--", "python", "t.py"], env)
    with pytest.raises(ConfigError, match=r"NVRX_STANDBY_WAIT_S='x' is not a number"):
        config_from_args(["--", "python", "t.py"], dict(env, NVRX_STANDBY_WAIT_S="x"))


def test_a_warm_standby_variable_that_is_not_0_or_1_is_an_error() -> None:
    env = {"PATH": os.environ["PATH"], "NVRX_WARM_STANDBY": "off"}
    with pytest.raises(ConfigError, match=r"\$NVRX_WARM_STANDBY must be 0 or 1, got 'off'"):
        config_from_args(["--", "python", "t.py"], env)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("omp", [None, "3"])
def test_the_omp_notice_says_what_children_get(omp: str | None, tmp_path) -> None:
    """Two ranks on a node and no OMP_NUM_THREADS: one line says each gets 1 (as torchrun)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "nvrx.supervisor", "--nproc-per-node", "2", "--master-port",
         str(port - 1 if port > 1 else port), "--store-port", str(port), "--log-dir", str(tmp_path),
         "--", sys.executable, "-c", "import os; assert os.environ['OMP_NUM_THREADS'] == "
         f"{omp or '1'!r}"],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if "OMP_NUM_THREADS" in line]
    if omp is None:
        assert notices == [
            "nvrx-supervise: OMP_NUM_THREADS is unset: each of the 2 ranks of this node gets "
            "OMP_NUM_THREADS=1 (as torchrun does); set it to tune"
        ]
    else:
        assert notices == []


def test_only_a_job_of_one_node_given_no_port_takes_free_ports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {"PATH": os.environ["PATH"]}
    cfg, _ = config_from_args(["--", "python"], env)
    assert cfg.store_port == cfg.master_port + 3 and cfg.job_id == f"local-{cfg.store_port}"
    assert capsys.readouterr().err == (
        f"nvrx-supervise: no --master-port given; using free ports {cfg.master_port} (ranks' "
        f"MASTER_PORT) and {cfg.store_port} (nvrx store)\n"
    )
    with socket.socket() as sock:  # the pair is free: a server can bind each port
        sock.bind((cfg.master_addr, cfg.master_port))
    for argv, env_more in [
        (["--nnodes", "2", "--", "python"], {}),  # every node must compute the same ports
        (["--master-port", "30040", "--", "python"], {}),
        (["--store-port", "30041", "--", "python"], {}),
        (["--", "python"], {"PET_MASTER_PORT": "30042"}),  # torchrun's fallback is a port given
    ]:
        cfg, _ = config_from_args(argv, {**env, **env_more})
        assert "free ports" not in capsys.readouterr().err, argv
    assert (cfg.master_port, cfg.store_port) == (30042, 30045)


@pytest.mark.parametrize(
    ("abbreviation", "full"),
    [
        ("--nproc-per", "--nproc-per-node"),
        ("--max-rest", "--max-restarts"),
        ("--max_rest", "--max_restarts"),
    ],
)
def test_an_abbreviated_long_option_is_rejected_naming_it(abbreviation: str, full: str) -> None:
    env = {"PATH": os.environ["PATH"]}
    topology = ["--nnodes", "1", "--master-port", "30050"]
    config_from_args([*topology, full, "2", "--", "python"], env)
    with pytest.raises(ConfigError, match=f"unrecognized arguments: {abbreviation} "):
        config_from_args([*topology, abbreviation, "2", "--", "python"], env)


def _topology(nnodes: int = 3) -> list[str]:
    return ["--nnodes", str(nnodes), "--node-rank", "0", "--master-port", "30060"]


def test_options_not_given_take_the_defaults_the_help_gives() -> None:
    cfg, _ = config_from_args([*_topology(), "--", "python"], {"PATH": os.environ["PATH"]})
    got = (cfg.max_restarts, cfg.loop_breaker, cfg.grace_period, cfg.store_timeout,
           cfg.node_heartbeat, cfg.node_timeout, cfg.straggler_threshold, cfg.straggler_action,
           cfg.spare_nodes, cfg.min_nodes, cfg.warm_standby)  # fmt: skip
    assert got == (10, 3, 5.0, 60.0, 1.0, 5.0, 0.8, "report", 0, None, True)
    assert (cfg.job.master_port, cfg.job.store_port) == (30060, 30063)


def test_the_templates_variables_set_the_node_options_that_are_not_given() -> None:
    env = {"PATH": os.environ["PATH"], "NVRX_SPARE_NODES": "1", "NVRX_MIN_NODES": "2",
           "NVRX_NODE_TIMEOUT_S": "7"}  # fmt: skip
    cfg, _ = config_from_args([*_topology(), "--", "python"], env)
    assert (cfg.spare_nodes, cfg.min_nodes, cfg.node_timeout) == (1, 2, 7.0)
    given = ["--spare-nodes", "0", "--min-nodes", "1", "--node-timeout", "4"]
    cfg, _ = config_from_args([*_topology(), *given, "--", "python"], env)
    assert (cfg.spare_nodes, cfg.min_nodes, cfg.node_timeout) == (0, 1, 4.0)
    cfg, _ = config_from_args([*_topology(), "--", "python"], {**env, "NVRX_MIN_NODES": "0"})
    assert cfg.min_nodes is None  # 0: never shrink


def test_the_straggler_options_reach_the_configuration() -> None:
    argv = [*_topology(), "--straggler-action", "exclude", "--straggler-section", "step",
            "--straggler-threshold", "0.6", "--", "python"]  # fmt: skip
    cfg, _ = config_from_args(argv, {"PATH": os.environ["PATH"]})
    assert (cfg.straggler_action, cfg.straggler_section, cfg.straggler_threshold) == (
        "exclude", "step", 0.6,
    )  # fmt: skip


def test_torchruns_topology_variables_are_the_defaults_outside_slurm() -> None:
    env = {"PATH": os.environ["PATH"], "PET_NNODES": "4", "PET_NODE_RANK": "2",
           "PET_MASTER_ADDR": "10.0.0.7", "PET_MASTER_PORT": "30070"}  # fmt: skip
    cfg, _ = config_from_args(["--", "python"], env)
    assert (cfg.job.nnodes, cfg.job.node_rank, cfg.job.master_addr, cfg.job.master_port) == (
        4, 2, "10.0.0.7", 30070,
    )  # fmt: skip
    cfg, _ = config_from_args(["--node-rank", "1", "--", "python"], env)
    assert cfg.job.node_rank == 1  # an option given wins


@pytest.mark.timeout(60)
def test_a_store_host_that_is_another_machines_address_exits_2_naming_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a traceback from the bind (EADDRNOTAVAIL) and exit 1."""
    monkeypatch.delenv("NVRX_STORE_BIND", raising=False)
    result = _run("--master-addr", "192.0.2.1", "--master-port", "29500", "--store-port", "29507",
                  "--log-dir", str(tmp_path), "--", "true")  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("nvrx-supervise: error: node 0's store cannot listen at 192.0.2.1:29507")
    assert "must be an address of node 0, or set NVRX_STORE_BIND=all" in lines[0]


@pytest.mark.timeout(60)
def test_a_store_bind_that_is_another_machines_address_exits_2_naming_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the line blamed --master-addr (127.0.0.1 here, an address of this machine) and
    asked for NVRX_STORE_BIND=all, not naming the NVRX_STORE_BIND that was wrong."""
    monkeypatch.setenv("NVRX_STORE_BIND", "192.0.2.1")
    result = _run("--master-addr", "127.0.0.1", "--master-port", "29500", "--store-port", "29507",
                  "--log-dir", str(tmp_path), "--", "true")  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        "nvrx-supervise: error: node 0's store cannot listen at NVRX_STORE_BIND='192.0.2.1' (port 29507)"
    )
    assert "set NVRX_STORE_BIND to an address of node 0" in lines[0]
    assert "--master-addr" not in lines[0]


def _batch_shell(nodes: int) -> dict[str, str]:
    """The environment of a batch script of ``nodes`` nodes, as sbatch gives it: SLURM's
    variables of node 0, but no step (no ``SLURM_STEP_ID``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env.update(
        SLURM_JOB_ID="77", SLURM_JOB_NODELIST=f"node[1-{nodes}]" if nodes > 1 else "node1",
        SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes), SLURM_NODEID="0", SLURM_PROCID="0",
    )  # fmt: skip
    return env


def test_a_supervisor_in_the_batch_script_of_several_nodes_exits_2_naming_nvrx_srun() -> None:
    """Before: it took itself for node 0 of 2, waited for a node 1 that never started, and
    ended much later with exit 8, "node lost, no spare". The options are read first here, so
    that without the check no supervisor is started."""
    with pytest.raises(ConfigError) as refused:
        config_from_args(["--", "true"], _batch_shell(2))
    for said in ("SLURM_PROCID=0", "SLURM_NNODES=2", "SLURM_JOB_NUM_NODES=2", "no SLURM_STEP_ID",
                 "nvrx-srun", "srun --ntasks-per-node=1"):  # fmt: skip
        assert said in str(refused.value)
    result = subprocess.run(
        [sys.executable, "-m", "nvrx.supervisor.cli", "--", "true"],
        capture_output=True, text=True, timeout=60, env=_batch_shell(2),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"nvrx-supervise: error: {refused.value}"]


def test_a_batch_script_of_one_node_srun_steps_and_an_explicit_topology_still_start() -> None:
    one_node, _ = config_from_args(["--", "python"], _batch_shell(1))
    assert (one_node.nnodes, one_node.node_rank, one_node.job_id) == (1, 0, "77")
    step = _batch_shell(2) | {
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "1",
    }  # fmt: skip
    under_srun, _ = config_from_args(["--", "python"], step)
    assert (under_srun.nnodes, under_srun.node_rank, under_srun.master_addr) == (2, 1, "node1")
    explicit, _ = config_from_args(
        ["--nnodes", "2", "--node-rank", "0", "--master-addr", "node1", "--master-port", "30020",
         "--", "python"], _batch_shell(2),
    )  # fmt: skip
    assert (explicit.nnodes, explicit.node_rank, explicit.job_id) == (2, 0, "77")


def test_in_an_salloc_shell_the_supervisor_says_it_runs_outside_the_allocation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An salloc shell has SLURM_JOB_ID but no SLURM_PROCID: the supervisor runs a one-node job
    on the shell's host, which it says, naming nvrx-srun; a task srun started, and explicit
    topology, say nothing."""
    salloc = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2"}
    cfg, _ = config_from_args(["--master-port", "30050", "--", "python"], salloc)
    assert cfg.nnodes == 1
    assert capsys.readouterr().err.splitlines() == [
        "nvrx-supervise: warning: this shell holds SLURM job 77's allocation of 2 node(s), but "
        f"srun did not start this supervisor: it runs one node here, on {socket.gethostname()}; "
        "to run one per allocated node: nvrx-srun [options] -- COMMAND"
    ]
    config_from_args(["--nnodes", "1", "--master-port", "30050", "--", "python"], salloc)
    config_from_args(["--master-port", "30050", "--", "python"], {**salloc, "SLURM_PROCID": "0",
                     "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_NUM_NODES": "1",
                     "SLURM_STEP_NUM_TASKS": "1"})  # fmt: skip
    assert capsys.readouterr().err == ""


def test_a_torchrun_variable_of_an_option_given_is_neither_read_nor_checked() -> None:
    """As torchrun: ``$PET_*`` only stands in for an option not given (a Kubeflow pod's
    ``PET_NNODES=1:2`` does not stop ``--nnodes 1``)."""
    base = {"PATH": os.environ["PATH"]}
    cfg, _ = config_from_args(["--max-restarts", "3", "--", "python"], {**base, "PET_MAX_RESTARTS": "abc"})
    assert cfg.max_restarts == 3
    cfg, _ = config_from_args(["--nnodes", "1", "--", "python"], {**base, "PET_NNODES": "1:2"})
    assert cfg.job.nnodes == 1
    with pytest.raises(ConfigError, match=r"\$PET_NNODES \(for --nnodes\): '1:2': torchrun's MIN:MAX"):
        config_from_args(["--", "python"], {**base, "PET_NNODES": "1:2"})


@pytest.mark.parametrize(("short", "variable"), [("-r9", "PET_REDIRECTS"), ("-t9", "PET_TEE")])
def test_a_short_option_with_its_value_attached_is_not_blamed_on_its_variable(short, variable) -> None:
    env = {"PATH": os.environ["PATH"], variable: "1"}
    with pytest.raises(ConfigError) as info:
        config_from_args([short, "--", "python"], env)
    assert "9" in str(info.value) and variable not in str(info.value)
    with pytest.raises(ConfigError, match=rf"\${variable}"):  # the variable's own bad value
        config_from_args(["--", "python"], {**env, variable: "9"})


def test_node_settings_from_the_templates_variables_are_named_by_them() -> None:
    base = {"PATH": os.environ["PATH"]}
    with pytest.raises(ConfigError, match=r"^\$NVRX_SPARE_NODES must be in 0..2 .*got 5"):
        config_from_args([*_topology(), "--", "python"], {**base, "NVRX_SPARE_NODES": "5"})
    with pytest.raises(ConfigError, match=r"^\$NVRX_MIN_NODES must be in 1..3 .*got -1"):
        config_from_args([*_topology(), "--", "python"], {**base, "NVRX_MIN_NODES": "-1"})
    with pytest.raises(ConfigError, match=r"^--spare-nodes must be in 0..2"):
        config_from_args([*_topology(), "--spare-nodes", "5", "--", "python"], {**base, "NVRX_SPARE_NODES": "1"})
    # an option given: the variable is not read, nor checked
    cfg, _ = config_from_args([*_topology(), "--min-nodes", "1", "--", "python"], {**base, "NVRX_MIN_NODES": "abc"})
    assert cfg.min_nodes == 1


def test_the_commands_own_options_do_not_hide_torchruns_variables() -> None:
    """Without ``--`` the command begins at its first word: ``--nnodes``, ``-tp`` or
    ``--master_port`` of the training script are its own, not the supervisor's."""
    from nvrx.supervisor import cli, torchrun

    env = {"PET_NNODES": "2", "PET_TEE": "3", "PET_MASTER_PORT": "29500"}
    argv = ["--nproc-per-node", "1", "python", "train.py", "--nnodes", "4", "-tp", "8", "--master_port", "1"]
    options = cli._options_part(cli.build_parser(), argv)
    assert options == ["--nproc-per-node", "1"]
    assert torchrun.fallbacks(env, options) == {"nnodes": "2", "tee": "3", "master_port": "29500"}
    options = cli._options_part(cli.build_parser(), ["-t1", "--", *argv[2:]])
    assert torchrun.fallbacks(env, options) == {"nnodes": "2", "master_port": "29500"}
