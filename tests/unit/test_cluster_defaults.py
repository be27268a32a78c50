"""What distnb.cluster.cluster decides without starting anything: the default engines (CPU cores, visible GPUs) and how an
engine's exit is described."""

import psutil
import pytest

from distnb.cluster.defaults import default_spec
from distnb.core.net import visible_gpus


def test_cpu_default_is_one_engine_per_core(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spec = default_spec()
    cores = len(psutil.Process().cpu_affinity())
    assert spec.device_type == "cpu" and spec.backend == "gloo" and spec.num_engines == cores
    assert spec.num_engines * spec.num_threads <= cores


def test_gpu_count_comes_from_the_environment_without_cuda(monkeypatch):
    # No second GPU exists here: the visible-device list stands in for one.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == ["3", "5"]
    spec = default_spec()
    assert (spec.device_type, spec.backend, spec.num_engines) == ("cuda", "nccl", 2)
    with pytest.raises(Exception, match="more GPU engines"):
        default_spec(n=3)
    import sys

    if "torch" in sys.modules:
        import torch

        assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("code,expected", [(-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"),
                                           (1, "exited with status 1"), (None, "status unknown")])
def test_exit_descriptions(code, expected):
    from distnb.cluster.launchers import exit_description

    assert expected in exit_description(code)


def test_scale_on_a_launcher_that_cannot_resize_says_why_and_what_to_do():
    from distnb.cluster.engines import _not_resizable

    mpi = _not_resizable("mpi", 3)
    assert "one mpiexec job" in mpi and "fixed when mpiexec starts it" in mpi and "%dist restart -n 3" in mpi
    pbs = _not_resizable("pbs", 4)
    assert "one pbs batch job (--launcher pbs)" in pbs and "allocation (nodes and tasks) was fixed" in pbs
    assert "%dist restart -n 4" in pbs and "queue" in pbs
    other = _not_resizable("winhpc", 2)
    assert "the local and ssh launchers can" in other and "%dist restart -n 2" in other
