"""What people who know torchrun expect of the command lines: ``python -m`` entry points,
``--version``, underscore spellings of every option, ``--nproc-per-node auto|cpu|gpu``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nvrx
from nvrx.supervisor import nproc
from nvrx.supervisor.cli import build_parser, config_from_args
from nvrx.supervisor.config import ConfigError


@pytest.mark.parametrize(
    ("module", "program"), [("nvrx.supervisor", "nvrx-supervise"), ("nvrx.report", "nvrx-report")]
)
def test_python_m_runs_the_program_and_tells_its_version(module: str, program: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{program} {nvrx.__version__}"


def test_every_option_has_its_underscore_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # help lines unwrapped: every option in one piece
    text = build_parser().format_help()
    dashed = {o for o in re.findall(r"--[a-z]+(?:-[a-z]+)+", text) if not o.startswith("--no-")}
    assert "--nproc-per-node" in dashed and "--spare-nodes" in dashed
    for option in sorted(dashed):
        assert "--" + option[2:].replace("-", "_") in text, option


def test_underscore_spellings_mean_the_same() -> None:
    env = {"PATH": os.environ["PATH"]}
    cfg, _ = config_from_args(
        ["--nproc_per_node", "3", "--max_restarts", "7", "--spare_nodes", "0", "--", "python"], env
    )
    assert (cfg.nproc_per_node, cfg.max_restarts) == (3, 7)


def _driver(driver: Path, gpus: int) -> Path:
    """A stand-in for /proc/driver/nvidia/gpus listing ``gpus`` devices."""
    driver.mkdir()
    for k in range(gpus):
        (driver / f"0000:0{k}:00.0").mkdir()
    return driver


def test_nproc_keywords_count_as_torchrun_does(tmp_path: Path) -> None:
    four, none = _driver(tmp_path / "four", 4), _driver(tmp_path / "none", 0)
    cpus = len(os.sched_getaffinity(0))
    assert nproc.resolve("2", {}) == 2
    assert nproc.resolve("cpu", {}, four) == cpus
    assert nproc.resolve("gpu", {}, four) == 4 and nproc.resolve("auto", {}, four) == 4
    assert nproc.resolve("auto", {}, none) == cpus
    assert nproc.resolve("gpu", {"CUDA_VISIBLE_DEVICES": "1,3"}, four) == 2
    assert nproc.resolve("gpu", {"CUDA_VISIBLE_DEVICES": "0,-1,2"}, four) == 1  # CUDA stops at -1
    assert nproc.resolve("auto", {"CUDA_VISIBLE_DEVICES": ""}, four) == cpus
    assert nproc.resolve("+2", {}) == 2  # as int() and torchrun read it
    # CUDA_VISIBLE_DEVICES as CUDA reads it
    assert nproc.gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-5e1f,MIG-2a"}, four) == 2
    assert nproc.gpu_count({"CUDA_VISIBLE_DEVICES": "0,0"}, four) == 0  # repeated: none
    assert nproc.gpu_count({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, four) == 0
    assert nproc.gpu_count({"CUDA_VISIBLE_DEVICES": "2,7,3"}, four) == 1  # no GPU 7: stops there
    assert nproc.gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, none) == 0  # no driver, no GPU


@pytest.mark.parametrize(
    ("value", "env", "message"),
    [
        ("0", {}, "--nproc-per-node must be >= 1, got 0"),
        ("lots", {}, "--nproc-per-node must be a number or one of auto, cpu, gpu, got 'lots'"),
        ("gpu", {"CUDA_VISIBLE_DEVICES": ""}, "--nproc-per-node gpu: no GPU visible ("),
    ],
)
def test_bad_nproc_values_name_the_fix(value: str, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_args(
            ["--nproc-per-node", value, "--", "python"], {**env, "PATH": os.environ["PATH"]}
        )


@pytest.mark.parametrize(
    ("gpus", "visible", "why"),
    [
        (0, None, "the NVIDIA driver lists none under {driver}"),
        (0, "0,1,2", "the NVIDIA driver lists none under {driver}, and "
         "CUDA_VISIBLE_DEVICES='0,1,2' only narrows what it lists"),
        (4, "", "CUDA_VISIBLE_DEVICES='' names none"),
        (4, "7", "CUDA_VISIBLE_DEVICES='7' names none"),
    ],
)  # fmt: skip
def test_no_gpu_for_nproc_gpu_says_first_that_the_driver_lists_none(
    gpus: int, visible: str | None, why: str, tmp_path: Path
) -> None:
    """Before: CUDA_VISIBLE_DEVICES=0,1,2 on a machine whose driver lists no GPU was said
    to name none, as if the variable were wrong."""
    driver = _driver(tmp_path / "gpus", gpus)
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    message = f"--nproc-per-node gpu: no GPU visible ({why.format(driver=driver)}); give a number instead"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        nproc.resolve("gpu", env, driver)


def test_options_fall_back_to_torchruns_pet_variables() -> None:
    env = {"PATH": os.environ["PATH"], "PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "4"}
    cfg, _ = config_from_args(["--", "python"], env)
    assert (cfg.nproc_per_node, cfg.max_restarts) == (3, 4)
    cfg, _ = config_from_args(["--max-restarts", "6", "--", "python"], env)
    assert cfg.max_restarts == 6  # the option wins
    with pytest.raises(
        ConfigError,
        match=r"\$PET_MAX_RESTARTS \(for --max-restarts\) must be a whole number, got 'many'",
    ):
        config_from_args(["--", "python"], {**env, "PET_MAX_RESTARTS": "many"})
    with pytest.raises(ConfigError, match=r"got 'lots' \(from \$PET_NPROC_PER_NODE\)"):
        config_from_args(["--", "python"], {**env, "PET_NPROC_PER_NODE": "lots"})


def test_under_srun_pet_topology_is_ignored_slurm_gives_it() -> None:
    """One ``export PET_NNODES=4`` in a batch script reaches every task: it must not turn
    each node into node 0 of a job of its own."""
    env = {
        "PATH": os.environ["PATH"], "SLURM_JOB_ID": "55", "SLURM_PROCID": "2", "SLURM_NNODES": "3",
        "SLURM_JOB_NUM_NODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_NUM_NODES": "3",
        "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3",
        "PET_NNODES": "4", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "elsewhere", "PET_NPROC_PER_NODE": "2",
    }  # fmt: skip
    cfg, _ = config_from_args(["--", "python"], env)
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr) == (3, 2, "n1")
    assert cfg.nproc_per_node == 2  # not a topology option: it still applies


def test_a_keyword_nproc_says_what_it_counted(capsys: pytest.CaptureFixture[str]) -> None:
    cfg, _ = config_from_args(
        ["--nproc-per-node", "cpu", "--master-port", "30020", "--", "python"],
        {"PATH": os.environ["PATH"]},
    )  # (a port given: no line about free ports)
    assert (
        capsys.readouterr().err == f"nvrx-supervise: --nproc-per-node cpu: {cfg.nproc_per_node}\n"
    )
    assert cfg.nproc_per_node == len(os.sched_getaffinity(0))
