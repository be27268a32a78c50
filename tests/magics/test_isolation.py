"""Two notebooks on one machine (issue 4, behaviour 6): each kernel's own cluster, no clash, no cross-talk.

The first notebook is this test process's shared 2-rank cluster (the ``shell`` fixture); the
second is a real Jupyter kernel (jupyter_client) with its own ``%dist start``. A pinned
``--master-port`` that is taken is an error naming the port and the fix, at once.
"""

import json
import os
import time

import psutil
from jupyter_client import KernelManager

from distnb import session as session_mod
from support.ports import pinned_port

LOOP = """
import torch, torch.distributed as dist
bad = 0
for i in range(200):
    t = torch.full((256,), float(rank + 1) * {scale} + i)
    dist.all_reduce(t)
    bad += int(not torch.all(t == 3 * {scale} + 2 * i))
print('{tag}', rank, world_size, bad)
"""


def _execute(kc, code, timeout=90):
    """(stdout, error reply content or None) of ``code`` in the kernel."""
    out = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=out.append)
    text = "".join(m["content"].get("text", "") for m in out if m["msg_type"] == "stream")
    content = reply["content"]
    return text, (content if content["status"] != "ok" else None)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_second_kernel_has_its_own_cluster_and_pinned_ports_are_checked(shell, capsys):
    first = session_mod.current()
    a_status = first.status()
    a_pids = {a_status.controller_pid, *(r["pid"] for r in a_status)}
    taken = first.cluster.master_port  # the first notebook's store listens there
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "DISTNB_PROGRESS": "text"})
    kc = km.client()
    kc.start_channels()
    b_pids = set()
    try:
        kc.wait_for_ready(timeout=60)
        # a pinned port that is taken: the error names it and the fix, before any engine starts
        t0 = time.monotonic()
        _, err = _execute(kc, f"%load_ext distnb\n%dist start -n 2 --master-port {taken}")
        assert err is not None and err["ename"] == "ClusterError", err
        assert f"--master-port {taken} is already in use" in err["evalue"]
        assert "pick another port" in err["evalue"] and "leave out --master-port" in err["evalue"]
        assert time.monotonic() - t0 < 5
        assert _execute(kc, "import distnb.session as S\nprint(S._CURRENT)")[0].strip() == "None"
        # its own cluster, on a pinned free port
        port = pinned_port()
        _, err = _execute(kc, f"%dist start -n 2 --master-port {port}")
        assert err is None, err
        text, err = _execute(kc, "_t = get_ipython().run_line_magic('dist', 'status')\nimport json, distnb\n"
                                 "print(json.dumps(dict(pids=[_t.controller_pid, *[r['pid'] for r in _t]], "
                                 "store=_t.store, alive=[r['alive'] for r in _t], "
                                 "engines=sorted(distnb.current().cluster.client.ids))))")
        assert err is None, err
        b = json.loads(text.strip().splitlines()[-1])
        b_pids = set(b["pids"])
        assert b["alive"] == [True, True] and b["store"] == f"127.0.0.1:{port}" and b["engines"] == [0, 1]
        assert b_pids.isdisjoint(a_pids) and len(b_pids) == 3
        assert sorted(first.cluster.client.ids) == [0, 1]  # each controller knows only its own engines
        # both worlds run collectives at the same time; each sees its own ranks and sums
        msg_id = kc.execute("%%dist --all-output\nimport os\nprint('B-pid', rank, os.getpid())\n" +
                            LOOP.format(scale=100, tag="B"))
        capsys.readouterr()
        first.run("import os\nprint('A-pid', rank, os.getpid())\n" + LOOP.format(scale=1, tag="A"),
                  all_output=True)
        a_out = capsys.readouterr().out
        assert "[rank 0] A 0 2 0" in a_out and "[rank 1] A 1 2 0" in a_out, a_out
        out = []
        while True:  # B's output
            msg = kc.get_iopub_msg(timeout=90)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            if msg["msg_type"] == "error":
                raise AssertionError(msg["content"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        b_out = "".join(out)
        assert "[rank 0] B 0 2 0" in b_out and "[rank 1] B 1 2 0" in b_out, b_out
        b_rank_pids = {int(line.split()[-1]) for line in b_out.splitlines() if "B-pid" in line}
        assert b_rank_pids and b_rank_pids < b_pids
        # names stay in their own world
        first.run("only_in_a = 1")
        text, _ = _execute(kc, "%%dist --all-output\n'only_in_a' in globals()")
        assert text.count("False") == 2, text
        # a failure in B re-forms B's group on its pinned port; A is untouched
        a_generation = first.status()[0]["generation"]
        _, err = _execute(kc, "%%dist\nimport torch, torch.distributed as dist\nif rank == 1:\n"
                              "    raise ValueError('B fails')\ndist.all_reduce(torch.ones(1))")
        assert err is not None and "B fails" in err["evalue"], err
        text, err = _execute(kc, "%%dist --all-output\nimport os, torch, torch.distributed as dist\n"
                                 "t = torch.ones(1)\ndist.all_reduce(t)\nprint('again', t.item(), os.environ['MASTER_PORT'])")
        assert err is None, err
        assert text.count(f"[ranks 0-1] again 2.0 {port}") == 1, text  # both ranks printed it: shown once
        assert first.status()[0]["generation"] == a_generation
        _, err = _execute(kc, "%dist stop")
        assert err is None, err
        assert not any(_alive(p) for p in b_pids)
        assert all(_alive(p) for p in a_pids)  # stopping B left A alone
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in b_pids) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not any(_alive(p) for p in b_pids)
