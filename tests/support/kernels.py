"""Running code in a real Jupyter kernel through jupyter_client, as a notebook front end does."""

from __future__ import annotations

import queue
import time


def execute(kc, code: str, timeout: float = 120.0) -> tuple[str, str, dict | None]:
    """Run ``code`` in the kernel of client ``kc``; (stdout, stderr, error content or None) once it is idle.

    Raises TimeoutError when the kernel does not go idle within ``timeout`` seconds.
    """
    msg_id = kc.execute(code)
    streams, error = {"stdout": [], "stderr": []}, None
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no reply from the kernel within {timeout} s for {code!r}") from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            streams[content["name"]].append(content["text"])
        elif kind == "error":
            error = content
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(streams["stdout"]), "".join(streams["stderr"]), error
