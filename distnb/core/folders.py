"""Whether a folder can be created and written by this process (stdlib only: each rank checks with it the folder of a
``%dist save`` and a training cell's ``--checkpoint-dir`` and ``--log-dir`` before anything is written there)."""

from __future__ import annotations

import contextlib
import os
import tempfile


def unwritable(path: str) -> str:
    """Why the folder ``path`` cannot be created and written by this process ('' when it can).

    The nearest part of ``path`` that exists must be a folder in which a folder can be made and a file
    written in that (both tried, and removed: nothing is left behind; ``os.access`` says yes to root
    everywhere, /proc included, and ignores a read-only mount's full disk).

    Parameters
    ----------
    path : str
        The folder, existing or to be created (its missing parents too).

    Returns
    -------
    str
        '' when it can be written; else the reason, naming the part of ``path`` that is in the way
        (a file where a folder should be, a folder this process may not write).
    """
    probe = os.path.abspath(path)
    while True:
        try:
            os.lstat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):  # not there (yet), or below a file: the part above it
            probe = os.path.dirname(probe)
        except PermissionError as exc:  # the folder above may not be searched: nothing below it can be reached
            return f"{os.path.dirname(probe)} is closed to this process (its user may not enter it): {exc.strerror}"
    if not os.path.isdir(probe):
        return f"{probe} is a file, not a folder"
    where = "" if probe == os.path.abspath(path) else f" (to create {path} in)"
    try:
        made = tempfile.mkdtemp(prefix=".distnb-probe-", dir=probe)
    except OSError as exc:
        return f"{probe} is not writable{where}: {exc.strerror or exc}"
    file = os.path.join(made, "probe")
    try:
        with open(file, "wb") as f:
            f.write(b"distnb")
    except OSError as exc:
        return f"a file cannot be written in {probe}{where}: {exc.strerror or exc}"
    finally:
        with contextlib.suppress(OSError):
            os.remove(file)
        with contextlib.suppress(OSError):
            os.rmdir(made)
    return ""
