"""``%dist debug`` in a real Jupyter kernel, driven as a notebook front end drives it (issue 16, item 3).

A real kernel (jupyter_client) loads distnb, starts 2 ranks and runs a cell whose rank 1 raises
with a local tensor. ``%dist debug`` then runs pdb on rank 1: every command is the answer to
one of the kernel's ``input_request`` messages on the stdin channel (``input_reply``), as the
notebook's input box sends it, and the output is read from the iopub stream. A second session
(on rank 0) is ended by the interrupt button while the kernel waits for input; the next cell
runs, and ``%dist stop`` leaves no engine behind.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
from support.cells import failing_cell
from jupyter_client import KernelManager

pytestmark = pytest.mark.timeout(240)

FAILING = failing_cell("y")


def _execute(kc, code, answers=(), on_prompt=None, timeout=120):
    """Run ``code``; answer the kernel's input requests with ``answers`` in order.

    Returns (stdout text, stderr text, the prompts asked, error reply content or None). ``on_prompt(i)``, if
    given, is called at the i-th request instead of answering when ``answers`` have run out.
    """
    answers, prompts, out, err = list(answers), [], [], []

    def stdin_hook(msg):
        assert msg["msg_type"] == "input_request", msg
        prompts.append(msg["content"]["prompt"])
        if answers:
            kc.input(answers.pop(0))  # an input_reply, as the front end's input box sends it
        elif on_prompt is not None:
            on_prompt(len(prompts))
        else:
            raise AssertionError(f"unexpected input request {len(prompts)}: {msg['content']}")

    def output_hook(msg):
        if msg["msg_type"] == "stream":
            (out if msg["content"]["name"] == "stdout" else err).append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, allow_stdin=True, stdin_hook=stdin_hook, output_hook=output_hook,
                                   timeout=timeout)
    content = reply["content"]
    return "".join(out), "".join(err), prompts, (content if content["status"] != "ok" else None)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def kernel():
    km = KernelManager(kernel_name="python3")
    km.shutdown_wait_time = 10
    km.start_kernel(env={**os.environ, "DISTNB_PROGRESS": "text"})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def test_pdb_on_the_failed_rank_through_the_kernels_stdin(kernel):
    km, kc = kernel
    _, _, _, err = _execute(kc, "%load_ext distnb\n%dist start -n 2 --timeout 60")
    assert err is None, err
    text, _, _, err = _execute(kc, "_t = get_ipython().run_line_magic('dist', 'status')\nimport json\n"
                                "print(json.dumps([_t.controller_pid, *[r['pid'] for r in _t]]))")
    assert err is None, err
    pids = json.loads(text.strip().splitlines()[-1])
    t0 = time.monotonic()
    _, _, _, err = _execute(kc, FAILING)
    assert err is not None and err["ename"] == "RankError" and "bad batch on rank 1" in err["evalue"], err
    assert time.monotonic() - t0 < 20  # rank 0 did not wait out the 60 s timeout in its all_reduce

    commands = ["p x.shape", "pp x", "up", "l", "down", "pp locals()", "q"]
    text, _, prompts, err = _execute(kc, "%dist debug", answers=commands)
    assert err is None, err
    assert prompts == ["(Pdb) "] * len(commands)
    assert "post-mortem pdb on rank 1" in text and "ValueError: bad batch on rank 1" in text
    assert "step()" in text and "torch.Size([2, 3])" in text
    assert "tensor([[ 0.,  2.,  4.],\n        [ 6.,  8., 10.]])" in text
    assert "<module>()" in text and "->\ty = step(2.0)" in text and "def step(scale):" in text
    assert "'scale': 2.0" in text and "'x': tensor(" in text
    assert text.index("torch.Size([2, 3])") < text.index("<module>()") < text.index("'scale': 2.0")
    assert text.rstrip().endswith("frames were released")

    # the interrupt button while the kernel waits in input(): the session ends, the cluster stays usable
    text, _, prompts, err = _execute(kc, "%dist debug --rank 0", answers=["p rank"],
                                  on_prompt=lambda i: km.interrupt_kernel())
    assert len(prompts) == 2 and "post-mortem pdb on rank 0" in text and "\n0\n" in text, text
    assert "interrupted; its frames were released" in text, (text, err)

    text, _, _, err = _execute(kc, "%%dist --all-output\nimport torch, torch.distributed as dist\n"
                                "t = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())")
    assert err is None, err
    assert "sum 2.0" in text
    _, _, _, err = _execute(kc, "%dist debug")  # the cell released the frames
    assert err is not None and err["ename"] == "UsageError", err
    assert "rank 1 keeps no traceback" in err["evalue"] and "run the failing cell again" in err["evalue"]
    _, _, _, err = _execute(kc, "%dist stop")
    assert err is None, err
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
