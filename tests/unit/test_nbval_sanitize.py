"""The notebooks' output sanitizers (tests/nbval_sanitize.cfg) as nbval reads them."""

import os
import re

from nbval.plugin import get_sanitize_patterns

CFG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "nbval_sanitize.cfg")


def test_nbval_reads_every_regex_of_the_sanitizer_file():
    # nbval pairs "regex: X" with the next line only when it reads "replace: Y" (the space included): a bare
    # "replace:" made the binding note's pair silently unused
    text = open(CFG).read()
    pairs = get_sanitize_patterns(text)
    assert len(pairs) == len(re.findall(r"^regex:", text, flags=re.MULTILINE))
    for regex, _ in pairs:
        re.compile(regex)


def test_the_binding_notes_are_sanitized_and_nothing_else_with_them():
    pairs = get_sanitize_patterns(open(CFG).read())
    out = ("distnb: 2 ranks ready (gloo, cpu, 1 threads/rank) in 0.4 s\n"
           "distnb: the ranks are not bound to cores: other processes used 0.8 of this host's cores\n"
           "distnb: scaled the world from 2 ranks to 3 in 3.9 s (1 engine started; the process group re-formed)\n"
           "distnb: the ranks are no longer bound to cores: this host has 3 ranks now and only 2 cores for them\n"
           "distnb: the ranks are bound to cores of their own now, each to its share of this host's cores\n")
    for regex, replace in pairs:
        out = re.sub(regex, replace, out)
    assert out == ("distnb: 2 ranks ready (gloo, cpu, 1 threads/rank) in T s\n"
                   "distnb: scaled the world from 2 ranks to 3 in T s (1 engine started; the process group re-formed)\n")
