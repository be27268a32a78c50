"""The magics' help text (their docstrings), without a shell or a cluster."""

from distnb.magics import DistMagics


def test_every_verb_has_help_with_an_example():
    doc = DistMagics.dist.__doc__
    for verb in ("wait", "stop-training"):
        section = doc[doc.index(f"%dist {verb}"):]
        assert "Example" in section.split("::")[1]
    assert "--background" in DistMagics.distrain.__doc__ and "%dist wait" in DistMagics.distrain.__doc__
