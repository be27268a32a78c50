"""Notebook code sent by value keeps its file name and its source, so a rank's tracebacks show its lines.

cloudpickle (3.1 on) pickles a code object it sends by value (a class or function of the
notebook) with ``co_filename`` replaced by ``"<dynamic-code>"``, which makes the payload
deterministic; a rank's traceback through such a method then reads ``File <dynamic-code>:8``
with "Could not get source", and pdb's ``l`` shows nothing. :func:`reduce_code`, the code
reducer of :func:`distnb.engine.transport.wire.pack`, keeps the real name (the notebook cell's:
``<ipython-input-3-...>``, or ipykernel's ``/tmp/ipykernel_.../....py``) and, when the sending
process's :mod:`linecache` holds that file's text in memory (IPython registers every cell there,
a rank every ``%%dist`` cell), sends the text along (once per payload: pickle's memo shares
it among the cell's code objects). :func:`make_code` registers it in the receiving process's
linecache under the same name, where it stays (an entry without a modification time is never
dropped by ``linecache.checkcache``). Stdlib only.
"""

from __future__ import annotations

import linecache
import types

#: What cloudpickle writes in place of a code object's file name.
PLACEHOLDER = "<dynamic-code>"
#: Sources larger than this (characters) are not sent: the frames keep their name, without lines.
MAX_SOURCE_CHARS = 1 << 20


def source_lines(filename: str):
    """The lines linecache holds in memory for ``filename`` (a notebook cell), or None.

    Only entries without a modification time count (IPython's cells, distnb's ``%%dist`` cells):
    a file on disk is not sent, the receiver reads its own copy if it has one.
    """
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) != 4 or entry[1] is not None or not isinstance(entry[2], list):
        return None
    lines = entry[2]
    return lines if sum(map(len, lines)) <= MAX_SOURCE_CHARS else None


def register(filename: str, lines) -> None:
    """Put ``lines`` in linecache as ``filename``'s text, unless a file on disk holds that entry."""
    entry = linecache.cache.get(filename)
    if entry is not None and len(entry) == 4:
        if entry[1] is not None or entry[2] is lines or entry[2] == lines:
            return  # a real file's entry, or this text already
    linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)


def reduce_code(code: types.CodeType):
    """Reduce ``code`` as cloudpickle does, with its real ``co_filename`` and, if in memory, its source.

    Returns
    -------
    tuple
        ``(types.CodeType, args)`` when there is no source to send, else ``(make_code, (args, lines))``.
    """
    import cloudpickle

    make, args = cloudpickle.Pickler.dispatch_table[types.CodeType](code)  # cloudpickle's own reducer
    if PLACEHOLDER in args:
        at = args.index(PLACEHOLDER)
        args = args[:at] + (code.co_filename,) + args[at + 1:]
    lines = source_lines(code.co_filename)
    return (make, args) if lines is None else (make_code, (args, lines))


def make_code(args: tuple, lines: list) -> types.CodeType:
    """The code object of ``args`` (as ``types.CodeType`` takes them); its file's ``lines`` go to linecache."""
    code = types.CodeType(*args)
    register(code.co_filename, lines)
    return code
