"""The demo's plain script (``--no-wrapper``): which process-group generation a process joins.

Each rank is a thread with a store client of its own, on a real ``TCPStore``. A rank's
replacement declares the generation its predecessor died in broken; the ranks already
waiting there must join the next one at once, not wait out their timeout (their
timeouts, one after the other, moved the generation on again and again). A replacement
started after the training finished joins none: there is nothing left to do.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from nvrx.events.reader import read_dir
from tests.support.ports import free_ports

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_demo.py"
WAIT_S = 600.0  # far past each test's timeout: a test that waits it out fails


def load_demo() -> Any:
    """The demo script as a module."""
    spec = importlib.util.spec_from_file_location("train_demo_under_test", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def host() -> Any:
    (port,) = free_ports(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del store


def _client(port: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))


def _join_in_thread(port: int, rank: int, world: int, joined: dict[int, int]) -> threading.Thread:
    demo = load_demo()

    def join() -> None:
        joined[rank] = demo.join_generation(_client(port), rank, world, WAIT_S)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_the_first_processes_join_generation_0_together(host: int) -> None:
    joined: dict[int, int] = {}
    threads = [_join_in_thread(host, rank, 3, joined) for rank in range(3)]
    for thread in threads:
        thread.join()
    assert joined == {0: 0, 1: 0, 2: 0}


@pytest.mark.timeout(60)
def test_a_rank_waiting_in_a_broken_generation_joins_the_next_at_once(host: int) -> None:
    store = _client(host)
    store.set("demo/generation_of/1", "0")  # rank 1's first process ran in generation 0 and died
    joined: dict[int, int] = {}
    waiting = _join_in_thread(host, 0, 2, joined)  # rank 0 joins generation 0 and waits for 1
    store.wait(["demo/join0/arrived"], timedelta(seconds=30))
    replacement = _join_in_thread(host, 1, 2, joined)  # rank 1's replacement: 0 is broken
    for thread in (waiting, replacement):
        thread.join()
    assert joined == {0: 1, 1: 1}
    assert store.get("demo/join0/ready") == b"broken" and store.get("demo/join1/ready") == b"all"


def _checkpoint_at(demo: Any, path: Path, step: int) -> None:
    import torch

    model = demo.build_model(torch)
    demo.save_checkpoint(torch, path, step, model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.timeout(120)
def test_a_replacement_after_training_finished_exits_0_without_joining(
    host: int, tmp_path: Path
) -> None:
    """A rank that dies after the last step (gloo may abort a process at exit) is replaced; its
    peers are gone, so the replacement must not wait for a generation that never forms."""
    demo = load_demo()
    _checkpoint_at(demo, tmp_path / "checkpoint.pt", 8)
    env = {
        **os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        "NVRX_STORE_HOST": "127.0.0.1", "NVRX_STORE_PORT": str(host),
        "NVRX_LOG_DIR": str(tmp_path / "logs"), "NVRX_JOB_ID": "finished",
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(DEMO), "--no-wrapper", "--steps", "8", "--run-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "training already finished at step 8" in done.stdout
    assert not _client(host).check(["demo/generation_of/1"])  # it joined no generation
    found, _ = read_dir(tmp_path / "logs" / "finished")
    assert [(e["kind"], e.get("reason")) for e in found] == [
        ("process_start", None), ("process_end", demo.ALREADY_FINISHED),
    ]  # fmt: skip


def test_a_checkpoint_short_of_the_last_step_is_not_the_end(tmp_path: Path) -> None:
    demo = load_demo()
    ckpt = tmp_path / "checkpoint.pt"
    assert demo.finished_step(ckpt, 8) is None  # no checkpoint yet
    _checkpoint_at(demo, ckpt, 5)
    assert demo.finished_step(ckpt, 8) is None
    _checkpoint_at(demo, ckpt, 8)
    assert demo.finished_step(ckpt, 8) == 8
