"""The documentation builds with no warning and no broken reference, and its reference lists every declared option.

``sphinx-build -W -n`` (nitpicky: a cross-reference to something undocumented is a warning, and
``-W`` makes every warning an error) runs once for the module, into a temporary folder. The
option reference is generated from the declarations (``docs/_ext/distnb_reference.py``); the
second test reads the declarations itself, not a hand list, and looks for each option in the
built page.
"""

import html
import os
import pathlib
import re
import subprocess
import sys

import pytest

from distnb import magics
from distnb.core import options, plan

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The build takes about 10 s on 2 busy cores; a build that takes 10 times that is a failure too.
BUILD_SECONDS = 110


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs-html")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
                           "-d", str(out / ".doctrees"), str(ROOT / "docs"), str(out)],
                          capture_output=True, text=True, timeout=BUILD_SECONDS, env=env, cwd=ROOT)
    return proc, out


@pytest.mark.timeout(BUILD_SECONDS + 30)
def test_the_docs_build_with_no_warning_and_no_broken_reference(built):
    proc, _ = built
    assert proc.returncode == 0, f"sphinx-build -W -n failed:\n{proc.stderr[-6000:]}"
    assert "WARNING" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr[-6000:]


def _text(page: pathlib.Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.mark.timeout(BUILD_SECONDS + 30)
def test_every_declared_option_appears_in_the_reference_with_its_facts(built):
    proc, out = built
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (out / "reference" / "options.html").read_text()
    missing, wrong = [], []
    for magic, classes in (("dist-start", (plan.ClusterSpec,)), ("distrain", (plan.TrainPlan, plan.RunOptions))):
        for cls in classes:
            for f, opt in options.declared(cls):
                if not (opt.cli or opt.api):
                    continue  # set by distnb itself (device_type, num_threads): no option of a magic or keyword
                anchor = f'id="option-{magic}-{f.name.replace("_", "-")}"'
                at = page.find(anchor)
                if at < 0:
                    missing.append(f"{cls.__name__}.{f.name}")
                    continue
                entry = html.unescape(re.sub(r"<[^>]+>", "", page[at:page.find("</dd>", at)]))
                names = options.flags_of(f, opt) if opt.cli else (opt.keyword or f.name,)
                carries = "carries between cells: " + ("yes" if options.carries(opt) else "no")  # "no, but ..." too
                first_words = " ".join((opt.doc or opt.help).replace("``", "").split()[:3])
                if not all(n in entry for n in names) or carries not in entry or first_words not in entry:
                    wrong.append(f"{cls.__name__}.{f.name}: names {names}, {carries!r}, help {first_words!r}: {entry[:300]!r}")
    assert not missing, f"declared options missing from docs/reference/options.md: {missing}"
    assert not wrong, "options whose reference entry lacks its flags, carry-over or help:\n" + "\n".join(wrong)


@pytest.mark.timeout(BUILD_SECONDS + 30)
def test_every_magic_and_verb_appears_in_the_reference_with_its_help(built):
    proc, out = built
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = _text(out / "reference" / "magics.html")
    for verb, fn in magics.VERBS.items():
        assert f"%dist {verb}" in text, verb
        first = " ".join((fn.parser.description or "").split()[:4])  # the docstring (magic_arguments made __doc__ the help)
        assert first in " ".join(text.split()), (verb, first)
    for title in ("%%dist", "%%distrain"):
        assert title in text
