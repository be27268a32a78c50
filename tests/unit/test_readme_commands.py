"""The READMEs' and the docs' shell commands run as written on a fresh clone after `make demo`/`make test`.

Those create `.venv/`, which is not on PATH: a bare `torchrun` (the README's export line) failed with
"command not found". Each fenced shell block that runs a tool of the environment either activates it
first or calls the tool by its path in `.venv/bin`, and the set-up section says how to use it.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: Commands that come from the environment `make` creates (.venv/bin), not from the system.
TOOLS = ("torchrun", "jupyter", "ipython", "python", "python3", "pip", "pytest", "ipcluster", "nbval")
ACTIVATE = re.compile(r"^(\.|source) \.venv/bin/activate\b")


def shell_blocks(text):
    return re.findall(r"^```(?:bash|sh|shell|console)\n(.*?)^```", text, flags=re.S | re.M)


def commands(line):
    """The commands of a shell line (split at ;, &&, ||, |), comments dropped."""
    line = line.split(" #", 1)[0].strip()
    return [c.strip() for c in re.split(r"&&|\|\||;|\|", line) if c.strip()]


def test_every_shell_command_of_an_environment_tool_uses_the_environment():
    bare = []
    for readme in (ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))):
        for block in shell_blocks(readme.read_text()):
            active = False
            for line in block.splitlines():
                for command in commands(line):
                    if ACTIVATE.match(command):
                        active = True
                    word = command.split()[0]
                    if word in TOOLS and not active:
                        bare.append(f"{readme.relative_to(ROOT)}: {line.strip()}")
    assert not bare, f"commands that need .venv activated (or .venv/bin/ before them): {bare}"


def test_the_set_up_says_how_to_use_the_environment_make_creates():
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    assert ". .venv/bin/activate" in setup and "Python 3 (distnb)" in setup
    assert ".venv/bin/torchrun" in setup and ".venv/bin/jupyter" in setup
    spec = (ROOT / "jupyter-config" / "kernels" / "distnb" / "kernel.json").read_text()
    assert '"display_name": "Python 3 (distnb)"' in spec  # the kernel the set-up names
