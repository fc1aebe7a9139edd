"""Health checks on CPU: CudaHealthCheck is a no-op, FaultCounter counts this rank's faults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nvrx.inprocess.exception import RestartError
from nvrx.inprocess.health_check import (
    CudaHealthCheck,
    FaultCounter,
    FaultCounterExceeded,
    HealthCheck,
)
from nvrx.inprocess.state import State


def _state(exc=None):
    return State(rank=0, world_size=2, fn_exception=exc).freeze()


@pytest.mark.timeout(120)
def test_cuda_health_check_is_a_noop_without_cuda_and_loads_no_nvml():
    # In a fresh interpreter, so that nothing else initialized CUDA or loaded NVML before.
    code = (
        "import sys, os\n"
        "os.environ['LOCAL_RANK'] = '0'\n"
        "from nvrx.inprocess.health_check import CudaHealthCheck\n"
        "from nvrx.inprocess.state import State\n"
        "s = State(rank=0, world_size=1).freeze()\n"
        "assert CudaHealthCheck(timeout=1)(s) is s\n"
        "import torch\n"
        "assert not torch.cuda.is_initialized()\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libnvidia-ml' not in maps, 'NVML was loaded'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_fault_counter_counts_only_rounds_where_this_rank_raised():
    counter = FaultCounter(max_rank_faults=2)
    assert isinstance(counter, HealthCheck)
    counter(_state())
    counter(_state(ValueError("1")))
    counter(_state())
    counter(_state(ValueError("2")))
    assert counter.faults_count == 2
    with pytest.raises(FaultCounterExceeded, match="3 times, more than max_rank_faults=2"):
        counter(_state(KeyError("3")))
    assert issubclass(FaultCounterExceeded, RestartError)


def test_fault_counter_without_limit_and_bad_limit():
    counter = FaultCounter()
    for _ in range(50):
        counter(_state(RuntimeError()))
    assert counter.faults_count == 50
    counter.reset()
    assert counter.faults_count == 0
    with pytest.raises(ValueError, match="max_rank_faults"):
        FaultCounter(max_rank_faults=-1)
    with pytest.raises(ValueError, match="timeout"):
        CudaHealthCheck(timeout=-5)
