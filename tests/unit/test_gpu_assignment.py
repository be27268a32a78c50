"""GPUs without a GPU: discovery (finding 13), one GPU per rank (finding 9), LOCAL_RANK naming the device (finding 5),
and the nccl failure path's pure parts (finding 1). Pure functions over host layouts; no CUDA, no torch."""

import stat

import pytest

from distnb.core import gpus
from distnb.cluster import placement
from distnb.engine.process import ncclfail
from distnb.core.errors import ClusterError
from distnb.core.plan import ClusterSpec


# discovery ------------------------------------------------------------------------------
def _fake_smi(tmp_path, out):
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{out}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_discovery_says_which_source_answered(tmp_path):
    empty = tmp_path / "none"
    assert gpus.discover({"CUDA_VISIBLE_DEVICES": "2,3"}, str(empty), str(empty), None) == \
        dict(gpus=["2", "3"], how="CUDA_VISIBLE_DEVICES")
    assert gpus.discover({"CUDA_VISIBLE_DEVICES": ""}, str(empty), str(empty), None)["gpus"] == []
    proc = tmp_path / "proc"
    proc.mkdir()
    for bus in ("0000:01:00.0", "0000:41:00.0"):
        (proc / bus).mkdir()
    assert gpus.discover({}, str(proc), str(empty), None) == dict(gpus=["0", "1"], how=str(proc))


def test_discovery_without_proc_driver_nvidia_asks_nvidia_smi_then_dev_nodes(tmp_path):
    """A sandbox (gVisor) without /proc/driver/nvidia: nvidia-smi -L, then /dev/nvidia<N>; never silently none."""
    empty = tmp_path / "none"
    smi = _fake_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\n"
                              "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)")
    assert gpus.discover({}, str(empty), str(empty), smi) == dict(gpus=["0", "1"], how="nvidia-smi -L")
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia1", "nvidia2"):
        (dev / name).touch()
    silent = _fake_smi(tmp_path, "No devices were found")  # nvidia-smi there, NVML finding nothing
    assert gpus.discover({}, str(empty), str(dev), silent) == dict(gpus=["0", "1", "2"], how="/dev/nvidia<N>")
    none = gpus.discover({}, str(empty), str(empty), None)
    assert none == dict(gpus=[], how="none")
    assert "nvidia-smi -L" in gpus.describe(none) and gpus.describe(
        dict(gpus=["0"], how="nvidia-smi -L")) == "1 GPU (found by nvidia-smi -L)"


# one GPU per rank -----------------------------------------------------------------------
def _where(layout):
    """``{engine_id: whereami-like info}`` and places for ``layout``: [(host, gpus the engine sees, how)]."""
    where, places, local = {}, [], {}
    for eid, (host, seen, how) in enumerate(layout):
        where[eid] = dict(host=host, address=host, cores=8, gpus=list(seen), gpus_how=how)
        local[host] = local.get(host, -1) + 1
        places.append(dict(engine_id=eid, node=host, node_rank=sorted({h for h, _, _ in layout}).index(host),
                           local_rank=local[host]))
    return where, places


PROC = "/proc/driver/nvidia/gpus"
LAYOUTS = {
    # name: (engines as (host, GPUs the engine sees, how found), duplicated ranks expected)
    "one host, one engine per GPU": ([("a", "0123", PROC)] * 4, []),
    "one-GPU hosts, one engine each": ([("a", "0", PROC), ("b", "0", PROC)], []),
    "one-GPU host, two engines": ([("a", "0", PROC), ("a", "0", PROC)], [[0, 1]]),
    "two hosts, the one-GPU one with two engines": ([("a", "0", PROC)] * 2 + [("b", "01", PROC)] * 2, [[0, 1]]),
    "slurm --gpus-per-task=1 (each engine its own GPU, called 0)": (
        [("a", "0", "CUDA_VISIBLE_DEVICES"), ("a", "0", "CUDA_VISIBLE_DEVICES")], []),
    "CUDA_VISIBLE_DEVICES=0,0 (one GPU twice)": ([("a", ["0", "0"], "CUDA_VISIBLE_DEVICES")] * 2, [[0, 1]]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_duplicate_gpus_for_every_host_layout(name):
    layout, expected = LAYOUTS[name]
    where, places = _where([(h, list(g), how) for h, g, how in layout])
    assigned = placement.rank_gpus(places, where, "cuda")
    found = placement.gpu_duplicates(places, where, assigned)
    assert [ranks for _, _, ranks in found] == expected
    spec = ClusterSpec(num_engines=len(places), backend="nccl", device_type="cuda")
    if expected:
        with pytest.raises(ClusterError, match="Duplicate GPU") as info:
            placement.check_gpus(places, where, assigned, "nccl")
        assert f"ranks {', '.join(map(str, expected[0]))}" in str(info.value)
        with pytest.raises(ClusterError, match="needs a GPU of its own"):
            placement.fit_to_hosts([dict(p) for p in places], where, spec)
        gloo = ClusterSpec(num_engines=len(places), backend="gloo", device_type="cpu")  # no --backend on other hosts
        auto = placement.fit_to_hosts([dict(p) for p in places], where, gloo, auto_device=True)
        assert (auto.backend, auto.device_type) == ("gloo", "cpu")  # auto mode: not nccl on a shared GPU
    else:
        placement.check_gpus(places, where, assigned, "nccl")
    placement.check_gpus(places, where, assigned, "gloo")  # gloo shares a GPU (CUDA tensors through the host)


def test_shrink_then_grow_gives_the_added_rank_the_freed_gpu():
    """A GPU rank keeps its local rank when another leaves (Engines.remove_ranks), and an added engine takes the
    smallest free one: the freed GPU, never a survivor's (before: local ranks renumbered, the added rank got GPU 2
    of the survivor that became local rank 1)."""
    where, places = _where([("a", list("0123"), PROC)] * 3)
    survivors = [places[0], places[2]]  # rank 1 (GPU 1) left; GPU ranks keep local ranks 0 and 2
    where[3] = dict(where[0])
    grown = placement.extend_ranks(survivors, where, [3])
    assert [p["local_rank"] for p in grown] == [0, 2, 1]
    assigned = placement.rank_gpus(grown, where, "cuda")
    assert assigned == ["0", "2", "1"] and placement.gpu_duplicates(grown, where, assigned) == []
    cpu = placement.extend_ranks([dict(p, local_rank=i) for i, p in enumerate(survivors)], where, [3])
    assert [p["local_rank"] for p in cpu] == [0, 1, 2]  # CPU ranks renumbered: the next one, as before


def test_local_world_sizes():
    _, places = _where([("a", "01", PROC)] * 2 + [("b", "0", PROC)])
    assert placement.local_world_sizes(places) == [2, 2, 1]


# LOCAL_RANK names the device ---------------------------------------------------------------
@pytest.mark.parametrize("visible,gpu,local_rank,expected", [
    (["0", "1", "2", "3"], "2", 2, (["0", "1", "2", "3"], 2)),  # torchrun's layout: nothing moves
    (["0", "1", "2", "3"], "1", 2, (["0", "2", "1", "3"], 2)),  # a freed GPU given to local rank 2
    (["0", "1"], "0", 1, (["1", "0"], 1)),
    (["3"], "3", 1, (["3"], 0)),  # a launcher gave the engine its own GPU: cuda:0
    (["GPU-aa", "GPU-bb"], "GPU-bb", 0, (["GPU-bb", "GPU-aa"], 0)),
])
def test_layout_puts_the_rank_gpu_at_local_rank(visible, gpu, local_rank, expected):
    order, index = gpus.layout(visible, gpu, local_rank)
    assert (order, index) == expected
    assert order[index] == gpu and sorted(order) == sorted(visible if gpu in visible else [gpu])


def test_every_rank_of_a_host_sees_its_gpu_at_local_rank():
    """For every rank of a 4-GPU host (and after shrink then grow), cuda:<LOCAL_RANK> is the rank's own GPU."""
    where, places = _where([("a", list("0123"), PROC)] * 4)
    grown = placement.extend_ranks([places[0], places[1], places[3]], where, [2])
    for p, gpu in zip(grown, placement.rank_gpus(grown, where, "cuda")):
        order, index = gpus.layout(list("0123"), gpu, p["local_rank"])
        assert index == p["local_rank"] and order[index] == gpu


# nccl failure path, pure parts -----------------------------------------------------------
def test_nccl_environment_keeps_what_the_user_set():
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    assert ncclfail.set_env(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}


def test_flight_recorder_rows_name_the_oldest_pending_collective():
    trace = {"version": "2.5", "entries": [
        dict(profiling_name="nccl:all_reduce", collective_seq_id=7, state="completed",
             process_group=("0", "default_pg"), input_sizes=[[4]]),
        dict(profiling_name="nccl:broadcast", collective_seq_id=9, state="scheduled", process_group=("0", "default_pg"),
             input_sizes=[[2]]),
        dict(profiling_name="nccl:all_reduce", collective_seq_id=8, state="started", process_group=("0", "default_pg"),
             input_sizes=[[3, 4]])]}
    rows = ncclfail.entries(trace, limit=2)
    assert [r["seq"] for r in rows] == [8, 9] and rows[0]["group"] == "default_pg"
    assert ncclfail.describe(rows[0]) == "nccl:all_reduce #8 (started, waiting for the peers)"
    assert ncclfail.pending() == []  # a CPU build of torch has no flight recorder: nothing, no error


def test_the_start_says_what_discovery_found():
    from distnb.cluster.startup import gpu_note

    assert gpu_note("cuda", dict(gpus=["0", "1"], how="nvidia-smi -L"), True) == \
        "GPUs: 2 GPUs (found by nvidia-smi -L)"
    silent = gpu_note("cpu", dict(gpus=[], how="none"), True)  # a sandbox: a driver, no GPU found
    assert silent.startswith("no GPU found (looked at /proc/driver/nvidia/gpus, nvidia-smi -L") and \
        "CUDA_VISIBLE_DEVICES" in silent
    assert gpu_note("cpu", dict(gpus=[], how="none"), False) == ""  # a CPU machine: nothing to say
