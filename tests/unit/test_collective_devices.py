"""Every tensor distnb hands a collective is made on the group's device (GPU review, finding 2).

A process group formed for nccl alone has no backend for CPU tensors: ``dist.broadcast`` of a CPU
tensor raises "No backend type associated with device type cpu", even in a world of one rank. CPU
CI runs gloo, where a CPU tensor works, so a call site that builds its tensor on the CPU passes every
CPU test and breaks on the first GPU (``%dist scale`` did). This test reads distnb's source: the tensor
of each collective call must be built or moved in the same function with
:func:`distnb.engine.process.collectives.group_device` / ``on_group`` (or ps's gloo group's ``COMM_DEVICE``);
a tensor that is the model's own (a buffer, a gradient's flag) says so on the call line with a
``# group device: <why>`` comment. The run-time half (each call's tensor on ``group_device(group)``)
is tests/cluster/test_collective_devices_ranks.py.
"""

import ast
import pathlib

import distnb

ROOT = pathlib.Path(distnb.__file__).parent
#: torch.distributed functions whose first argument (or the named one) is a tensor, or a list of them.
TENSOR_COLLECTIVES = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor_list",
                      "all_gather_into_tensor": "output_tensor", "reduce_scatter_tensor": "output",
                      "reduce_scatter": "output", "gather": "tensor", "scatter": "tensor", "send": "tensor",
                      "recv": "tensor", "isend": "tensor", "irecv": "tensor", "all_to_all_single": "output"}
#: ProcessGroup methods (``group.allreduce([t])``) that take a list of tensors.
GROUP_METHODS = {"allreduce", "send", "recv", "broadcast"}
#: What places a tensor on the group's device.
HELPERS = ("group_device(", "on_group(", "COMM_DEVICE")
MARK = "# group device:"


def _calls(tree):
    """(call, its enclosing function) for every collective call in ``tree``."""
    out = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "dist" and node.func.attr in TENSOR_COLLECTIVES:
                out.append((node, func))
            elif isinstance(owner, ast.Name) and owner.id in ("group", "pg") and node.func.attr in GROUP_METHODS:
                out.append((node, func))
    return out


def _tensor_names(call) -> list:
    """The names the tensor argument of ``call`` is read from (``bufs[s]`` -> bufs, ``[t]`` -> t)."""
    arg = call.args[0] if call.args else None
    if arg is None:
        want = TENSOR_COLLECTIVES.get(call.func.attr)
        arg = next((k.value for k in call.keywords if k.arg == want), None)
    names = []
    for node in ast.walk(arg) if arg is not None else ():
        if isinstance(node, ast.Name):
            names.append(node.id)
    return names


def _built_with_helper(func, source: str, names: list, line: int) -> bool:
    """Whether the last binding before ``line`` in ``func`` of each of ``names`` that is bound there uses a
    helper (at least one is bound: a parameter alone, or a tensor made in another function, needs the mark)."""
    last = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            targets = [node.target]
        else:
            continue
        bound = set()
        for target in targets:  # names rebound, not items written (sums[0] = ...)
            todo = [target]
            while todo:
                t = todo.pop()
                if isinstance(t, ast.Name):
                    bound.add(t.id)
                elif isinstance(t, (ast.Tuple, ast.List)):
                    todo.extend(t.elts)
        for name in bound & set(names):
            if node.lineno <= line and node.lineno >= last.get(name, (0, ""))[0]:
                last[name] = (node.lineno, ast.get_source_segment(source, node.value) or "")
    return bool(last) and all(any(h in text for h in HELPERS) for _, text in last.values())


def violations(path: pathlib.Path) -> list:
    source = path.read_text()
    lines = source.splitlines()
    bad = []
    for call, func in _calls(ast.parse(source)):
        line = lines[call.lineno - 1]
        if MARK in line or MARK in lines[call.lineno - 2]:
            continue
        if not _built_with_helper(func, source, _tensor_names(call), call.lineno):
            bad.append(f"{path.name}:{call.lineno}: {line.strip()}")
    return bad


def test_every_collective_tensor_is_built_on_the_group_device():
    bad = [v for path in sorted(ROOT.rglob("*.py")) for v in violations(path)]
    assert bad == [], ("collectives given a tensor not built with group_device()/on_group() (nccl groups refuse "
                       "CPU tensors):\n  " + "\n  ".join(bad))


def test_the_check_sees_the_call_sites():
    """The scan finds distnb's collectives (a scan that found none would pass on anything)."""
    found = {(p.name, c.func.attr) for p in ROOT.rglob("*.py") for c, _ in _calls(ast.parse(p.read_text()))}
    assert {("elastic.py", "broadcast"), ("datasets.py", "all_gather"), ("context.py", "all_reduce"),
            ("ps.py", "reduce"), ("abort.py", "allreduce")} <= found


def test_the_check_refuses_a_cpu_tensor(tmp_path):
    """The pattern of the grow bug (a CPU tensor broadcast) is refused; the fixed pattern passes."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(dist, torch, n):\n    flat = torch.empty(n, dtype=torch.uint8)\n"
                   "    dist.broadcast(flat, src=0)\n")
    good = tmp_path / "good.py"
    good.write_text("def f(dist, torch, n):\n    flat = torch.empty(n, device=group_device())\n"
                    "    dist.broadcast(flat, src=0)\n")
    assert len(violations(bad)) == 1
    assert violations(good) == []
