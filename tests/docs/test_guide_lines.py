"""Every magic line the docs show parses as written, and every choice they give an option is one it takes.

tests/unit/test_magic_help.py parses the documented magic lines that carry a comment; this parses all of
them (a guide that shows a wrong flag is a bug), and reads the values shown after a choice option
(``--precision bf16``, ``--schedule gpipe|1f1b``) against its declaration. Placeholders in capitals
(``--backend B``) and lines that elide with ``...`` or ``[...]`` are left out.
"""

import pathlib
import re

import pytest

from distnb.core import options, plan
from distnb.magics import VERBS, _cell, _distrain, _parse

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
MAGIC_LINE = re.compile(r"^\s*(%%?(?:dist|distrain))\b([^\n`]*)$", re.M)


def _choices() -> dict:
    out = {}
    for cls in (plan.ClusterSpec, plan.TrainPlan, plan.RunOptions):
        for f, opt in options.declared(cls):
            if opt.cli and getattr(opt, "choices", None):
                for flag in options.flags_of(f, opt):
                    out[flag] = {str(c) for c in opt.choices}
    return out


@pytest.mark.timeout(60)
def test_every_magic_line_in_the_docs_parses_as_written():
    checked, failed = 0, []
    for page in PAGES:
        for m in MAGIC_LINE.finditer(page.read_text()):
            magic, rest = m.group(1), options.uncommented(m.group(2))
            if "..." in rest or "[" in rest:
                continue  # an elided or bracketed synopsis, not a line to paste
            verb, _, args = rest.strip().partition(" ")
            try:
                if magic == "%%distrain":
                    _parse(_distrain, rest)
                elif magic == "%%dist":
                    _parse(_cell, rest)
                elif verb in VERBS:
                    _parse(VERBS[verb], args)
                elif verb not in ("", "help"):
                    raise ValueError(f"no verb {verb!r}")
            except BaseException as e:  # UsageError and argparse's SystemExit alike
                failed.append(f"{page.relative_to(ROOT)}: {m.group(0).strip()!r}: {type(e).__name__}: {e}")
            checked += 1
    assert checked >= 40, checked  # the guides show dozens; far fewer means the pattern stopped matching
    assert not failed, "\n".join(failed)


def _code(text: str):
    """(line number, code) for each fenced code line and each inline code span: where a value is an option's."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            yield n, line
        else:
            yield from ((n, span) for span in re.findall(r"`([^`]+)`", line))


def test_every_value_shown_for_a_choice_option_is_one_it_takes():
    choices, wrong = _choices(), []
    assert "--precision" in choices and "--cpu-bind" in choices, sorted(choices)
    for page in PAGES:
        for n, code in _code(page.read_text()):
            for m in re.finditer(r"(?<![\w-])(--[a-z][a-z-]*)[ =]([A-Za-z0-9_+.|-]+)", code):
                flag, value = m.groups()
                if flag not in choices:
                    continue
                for v in value.split("|"):
                    if v not in choices[flag] and not v.isupper() and not v.startswith("-"):
                        wrong.append(f"{page.relative_to(ROOT)}:{n}: {flag} {v} (takes {sorted(choices[flag])})")
    assert not wrong, "\n".join(wrong)
