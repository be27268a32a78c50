"""A real gloo world of a few processes in a script of its own, for engine code below the cluster (``mp.spawn``)."""

import subprocess
import sys

#: Ends a script whose ``main(rank, port)`` joins the group: spawns ``NPROCS`` of them on a free port.
SPAWN = '''

if __name__ == "__main__":
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    mp.spawn(main, args=(port,), nprocs=NPROCS)
    print("ok")
'''


def run_ranks(tmp_path, code: str, nprocs: int, timeout: float = 240) -> None:
    """Run ``code`` (defining ``main(rank, port)``) on ``nprocs`` spawned ranks; fail with their stderr unless all end well.

    The script is a file: ``mp.spawn``'s children import ``__main__`` from it (``python -c`` cannot be imported).
    """
    script = tmp_path / "ranks.py"
    script.write_text(code + SPAWN.replace("NPROCS", str(nprocs)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
