"""What ``--compile`` did in a cell, in words and figures, from a rank's report (:mod:`distnb.engine.strategies.compiling`).

A compile time is stated only when dynamo made graphs this cell: with none, the steps ran eagerly, and the
first step's extra time is something else (a cold cache, the machine's load), never compiling. When nothing
was ever compiled for the model, the note says so and why (dynamo's most frequent graph-break reasons).
"""

from __future__ import annotations

from distnb.core.tables import count


def compile_seconds(first: dict) -> float | None:
    """The first step's extra time over the later steps' median, seconds, when dynamo compiled graphs this cell
    (rank ``first``'s row); None otherwise (no --compile, no steps, or nothing compiled this cell)."""
    dynamo = first.get("dynamo")
    if not first.get("compiled") or first.get("first_step_seconds") is None:
        return None
    if dynamo is not None and not dynamo.get("graphs"):
        return None
    return max(0.0, first["first_step_seconds"] - first["step_seconds"])


def compiled_anything(first: dict) -> bool:
    """Whether the model runs compiled code (dynamo made at least one graph for it, this cell or before)."""
    dynamo = first.get("dynamo")
    return bool(first.get("compiled")) and (dynamo is None or dynamo.get("graphs_since_compile", 0) > 0)


def note(first: dict) -> str | None:
    """The sentence a --compile cell prints about what dynamo did on rank ``first["rank"]`` (None without
    --compile)."""
    if not first.get("compiled"):
        return None
    dynamo = first.get("dynamo")
    rank = first.get("rank", 0)
    if dynamo is None:  # a rank of another version: the timing only
        return _timing(first, "")
    if not dynamo.get("graphs_since_compile"):
        why = _breaks(dynamo) or "dynamo traced no frame of it"
        return (f"torch.compile compiled nothing on rank {rank}: dynamo made 0 graphs ({why}); the steps ran "
                "eagerly, so no compile time and no speed-up apply")
    did = [count(dynamo["graphs"], "graph") + " compiled this cell" if dynamo["graphs"]
           else f"no new graph this cell (the {count(dynamo['graphs_since_compile'], 'graph')} of an earlier "
                "cell reused)"]
    did.append(count(dynamo["graph_breaks"], "graph break") + (f" ({_breaks(dynamo)})" if dynamo["graph_breaks"]
                                                               else ""))
    recompiled = count(dynamo["recompiles"], "recompile")
    if dynamo["recompiles"] and dynamo.get("recompile_reasons"):
        recompiled += f" ({'; '.join(r for r in dynamo['recompile_reasons'] if r)})"
    did.append(recompiled)
    return _timing(first, f"torch.compile on rank {rank}: {', '.join(did)}")


def _breaks(dynamo: dict) -> str:
    """The most frequent graph-break reasons, ``reason x N``."""
    return "; ".join(f"{reason} x {n}" if n > 1 else reason for reason, n in dynamo.get("break_reasons", ()))


def _timing(first: dict, said: str) -> str:
    if first.get("first_step_seconds") is None:
        return said
    extra = compile_seconds(first)
    later = f"later steps {first['step_seconds'] * 1000:.1f} ms"
    if first.get("eager_step_seconds") and first["step_seconds"] > 0:
        later += f", {first['eager_step_seconds'] / first['step_seconds']:.2f}x the eager steps of an earlier cell"
    if extra is None:
        return f"{said}; {later}" if said else later
    lead = f"{said}; the first step" if said else "torch.compile: the first step"
    return f"{lead} took {first['first_step_seconds']:.1f} s ({extra:.1f} s compiling); {later}"
