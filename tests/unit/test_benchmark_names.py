"""benchmarks/ scripts import each other by file name (run.py puts benchmarks/ first on sys.path): a script named
like an installed package or a standard module shadows it there (benchmarks/transformers.py hid Hugging Face's
transformers from every benchmark that ran beside it)."""

import importlib.util
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_benchmark_script_shadows_a_module_of_this_environment():
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "run" in names and len(names) > 10
    def elsewhere(name):  # the module `import name` finds outside benchmarks/ (another test may have put it on the path)
        spec = importlib.util.find_spec(name)
        origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
        return spec is not None and (origin is None or origin.parent != BENCH)

    shadowed = sorted(n for n in names if n in sys.stdlib_module_names or elsewhere(n))
    assert shadowed == [], f"benchmarks/ scripts named like modules they would hide: {shadowed}"
