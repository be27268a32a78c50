"""Notebook code sent by value keeps its file name and source (distnb.engine.transport.sources through wire.pack)."""

import linecache

from distnb.engine.transport import wire

CELL = "<ipython-input-7-test-sources>"
SOURCE = "def scale(v):\n    k = 3\n    return v.no_such_attribute * k\n"


def _notebook_function(filename=CELL, source=SOURCE):
    """A function as a notebook cell defines it: in ``__main__`` (so it travels by value), its cell in linecache."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    ns = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), ns)
    return ns["scale"]


def test_a_function_by_value_keeps_its_cell_name_and_brings_the_cell_source():
    fn = _notebook_function()
    payload, descs, buffers = wire.pack(fn)
    assert b"<dynamic-code>" not in payload and payload.count(b"no_such_attribute * k") == 1
    del linecache.cache[CELL]  # the receiving process never ran the cell
    got = wire.loads(payload, descs, buffers)
    assert got.__code__.co_filename == CELL
    assert linecache.getline(CELL, 3) == "    return v.no_such_attribute * k\n"
    linecache.checkcache()  # kept: an entry without a modification time stays
    assert linecache.getline(CELL, 2) == "    k = 3\n"
    assert wire.pack(fn)[0] == payload  # still deterministic for one object


def test_code_without_source_in_memory_keeps_its_name_only_and_a_file_entry_is_left_alone(tmp_path):
    fn = _notebook_function(filename="<ipython-input-8-gone>")
    del linecache.cache["<ipython-input-8-gone>"]
    payload, descs, buffers = wire.pack(fn)
    assert wire.loads(payload, descs, buffers).__code__.co_filename == "<ipython-input-8-gone>"
    assert "<ipython-input-8-gone>" not in linecache.cache
    path = tmp_path / "cell.py"
    path.write_text("# the file on disk\n")
    fn = _notebook_function(filename=str(path))
    payload, descs, buffers = wire.pack(fn)  # the sender holds the cell's text in memory
    del linecache.cache[str(path)]
    linecache.getline(str(path), 1)  # the receiver has a real file of that name (an entry with its mtime)
    wire.loads(payload, descs, buffers)
    assert linecache.getline(str(path), 1) == "# the file on disk\n"
