"""What the GPU kit's scripts share (tests/gpu/device_run.sh): a shell with distnb, checks that record figures.

Every check is a function run by :meth:`Checks.run`: its figures (a dict it returns, or fills as
it goes) go into ``<dir>/<name>.json`` with ``ok``, ``seconds`` and, when it raised, ``error``;
a check that fails does not stop the next one. A check that needs a CUDA rank is skipped in
``--cpu`` mode, with its reason recorded. ``device_run.sh`` merges the files into one
``checks.json`` (the device call brings back 8 files at most).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prepare(cpu: bool) -> None:
    """Environment before distnb and torch load: private IPython dirs, and no GPU in ``--cpu`` mode."""
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="distnb-gpu-kit-"))
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)


def shell():
    """A real IPython shell (as a notebook's kernel) with ``%load_ext distnb`` done."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    cell(sh, "%load_ext distnb")
    return sh


def cell(sh, source: str, expect_error: bool = False):
    """Run ``source`` in ``sh``; returns the exception it raised (None); raises when that was not expected."""
    result = sh.run_cell(source)
    error = result.error_before_exec or result.error_in_exec
    if error is not None and not expect_error:
        raise RuntimeError(f"cell failed: {source[:200]!r}: {type(error).__name__}: {error}")
    return error


def gpu_memory() -> dict:
    """``nvidia-smi``'s view (used MiB per GPU, compute apps' pids), {} without it."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return {}
    out = {}
    for key, query in (("used_mib", ["--query-gpu=memory.used", "--format=csv,noheader,nounits"]),
                       ("compute_pids", ["--query-compute-apps=pid", "--format=csv,noheader"])):
        try:
            text = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True, timeout=20).stdout
            out[key] = [int(x) for x in text.split() if x.strip().isdigit()]
        except Exception as exc:  # a figure only
            out[key] = f"nvidia-smi: {exc}"
    return out


class Checks:
    """Runs named checks, records each one's figures as JSON and prints one line per check."""

    def __init__(self, prefix: str, cpu: bool, out_dir: str | None = None):
        self.prefix, self.cpu = prefix, cpu
        self.dir = out_dir or os.environ.get("CHECKS_DIR") or os.path.join(os.environ.get("OUT", "."), "checks")
        os.makedirs(self.dir, exist_ok=True)
        self.failed, self.done = [], []

    def run(self, name: str, fn, *args, cuda: bool = False, **kwargs) -> dict:
        """Run ``fn(figures, *args, **kwargs)``; ``cuda``: skipped in ``--cpu`` mode. Returns the figures."""
        figures = {"check": f"{self.prefix}.{name}"}
        t0 = time.perf_counter()
        if cuda and self.cpu:
            figures.update(ok=None, skipped="needs a CUDA rank (--cpu mode)")
        else:
            try:
                fn(figures, *args, **kwargs)
                figures.setdefault("ok", True)
            except Exception as exc:
                figures.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000],
                               traceback=traceback.format_exc()[-3000:])
        figures["seconds"] = round(time.perf_counter() - t0, 2)
        word = {True: "ok  ", False: "FAIL", None: "skip"}[figures["ok"]]
        brief = {k: v for k, v in figures.items() if k not in ("check", "ok", "traceback")}
        print(f"{word} {self.prefix}.{name}: {json.dumps(brief, default=str)[:600]}", flush=True)
        with open(os.path.join(self.dir, f"{self.prefix}.{name}.json"), "w") as f:
            json.dump(figures, f, indent=1, default=str)
        (self.failed if figures["ok"] is False else self.done).append(name)
        return figures

    def exit_code(self) -> int:
        print(f"{self.prefix}: {len(self.done)} checks passed or skipped, {len(self.failed)} failed "
              f"{self.failed or ''}", flush=True)
        return 1 if self.failed else 0


def expect(ok: bool, what: str) -> None:
    """A failed expectation: the check records ``what`` as its error."""
    if not ok:
        raise AssertionError(what)
