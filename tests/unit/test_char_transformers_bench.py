"""benchmarks/char_transformers.py's --device/--ranks: the CPU command lines stay as they were, cuda gets nccl's."""

import argparse
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, BENCH)  # its own imports (verdicts)
# by path, under its own name: Hugging Face's package is also called transformers
_spec = importlib.util.spec_from_file_location("char_transformers", os.path.join(BENCH, "char_transformers.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def parse(argv, gpus, monkeypatch):
    import distnb.core.net

    monkeypatch.setattr(distnb.core.net, "visible_gpus", lambda: list(range(gpus)))
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-bind", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ranks", type=int, default=None)
    args = p.parse_args(argv)
    return bench.check_device_args(p, args), args


def test_cpu_start_and_torchrun_lines_are_unchanged(monkeypatch):
    gpus, args = parse([], 0, monkeypatch)
    assert (gpus, args.ranks, args.cpu_bind) == (0, 2, "auto")
    assert bench.start_line() == "%dist start -n 2 --timeout 600 --hang-after 300 --cpu-bind auto"
    cmd = bench.torchrun_command("small", "ddp-bf16", 1, 1, 1)
    assert cmd[3:6] == ["--standalone", "--nproc-per-node", "2"] and "--device" not in cmd
    assert cmd[-2:] == ["--precision", "bf16"]


def test_cuda_lets_distnb_pick_one_engine_per_gpu(monkeypatch):
    gpus, args = parse(["--device", "cuda"], 1, monkeypatch)
    assert (gpus, args.ranks) == (1, 1)  # one GPU: a world of one rank
    assert bench.start_line("cuda", 1, None, 1) == "%dist start --timeout 600 --hang-after 300"
    assert bench.start_line("cuda", 2, None, 4).endswith(" -n 2")
    cmd = bench.torchrun_command("large", "fsdp", 1, 1, 1, "cuda", 4)
    assert cmd[5] == "4" and cmd[-2:] == ["--device", "cuda"]


@pytest.mark.parametrize("argv, gpus", [(["--device", "cuda"], 0), (["--device", "cuda", "--cpu-bind", "cores"], 2),
                                        (["--device", "cuda", "--ranks", "3"], 2), (["--ranks", "0"], 0)])
def test_bad_device_arguments_are_usage_errors(argv, gpus, monkeypatch):
    with pytest.raises(SystemExit):
        parse(argv, gpus, monkeypatch)
