"""Reference pages generated from distnb's declarations (a Sphinx extension).

Directives:

``.. distnb-options:: %dist start``
    Every option of a magic, from the dataclass fields that declare it (:mod:`distnb.core.options`:
    :class:`~distnb.core.plan.ClusterSpec` for ``%dist start``, :class:`~distnb.core.plan.TrainPlan` and
    :class:`~distnb.core.plan.RunOptions` for ``%%distrain``): its flags, Python keyword, type, default,
    whether it carries over between cells, and its help; then the arguments the magic's parser
    takes beside the declarations (``-o``), from the parser itself.
``.. distnb-verbs::``
    Every magic and ``%dist`` verb with its docstring and its parser's help, from
    :data:`distnb.magics.VERBS` and the parsers IPython's ``magic_arguments`` built.

Nothing here is written by hand, so an option added to a declaration appears in the reference
at the next build (``tests/docs`` checks that every declared option does).
"""

from __future__ import annotations

import dataclasses
import re

from docutils import nodes
from docutils.parsers.rst import Directive

#: magic -> (declaring classes, the magic's parser function name in distnb.magics)
MAGICS = {
    "%dist start": (("ClusterSpec",), "_start"),
    "%%distrain": (("TrainPlan", "RunOptions"), "_distrain"),
}


def _kind(opt) -> str:
    from distnb.core import options

    if opt.choices:
        return "one of " + ", ".join(map(str, opt.choices))
    return {"flag": "flag"}.get(opt.kind, options._TYPES[opt.kind])


def _default(f, opt) -> str:
    from distnb.core import options

    if f.default is dataclasses.MISSING and opt.given is options.FIELD_DEFAULT:
        return "required"
    if opt.given is None and opt.given is not options.FIELD_DEFAULT:  # "decide for me": resolved at start
        return "decided at start (see below)"
    given = options.given_of(f, opt)
    if given is None or (isinstance(given, tuple) and not given):
        return "none"
    return repr(given)


def _carries(f, opt) -> str:
    """Whether a left-out option keeps the model's last value: the declaration's rule (:func:`distnb.core.options.carries`),
    and, for an option whose left-out value (None) means the ranks' live one (``--lr``), that."""
    from distnb.core import options

    if options.carries(opt):
        return "yes"
    if options.given_of(f, opt) is None and "keep the live" in (opt.help + opt.doc):
        return "no, but left out it keeps the ranks' live value (see below)"
    return "no"


def option_rows(magic: str) -> list:
    """One dict per declared option of ``magic``: flags, keyword, kind, default, carries, help, id.

    Options neither the magic nor the Python API takes (set by distnb itself) are left out.
    """
    from distnb.core import options, plan

    rows = []
    for cls_name in MAGICS[magic][0]:
        for f, opt in options.declared(getattr(plan, cls_name)):
            if not (opt.cli or opt.api):
                continue
            rows.append(dict(
                name=f.name, flags=options.flags_of(f, opt) if opt.cli else (),
                keyword=(opt.keyword or f.name) if opt.api else None, kind=_kind(opt), default=_default(f, opt),
                carries=_carries(f, opt), help=opt.doc or opt.help, owner=cls_name,
                id=_anchor(magic, f.name)))
    return rows


def _anchor(magic: str, name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"option {magic} {name}".lower()).strip("-")


def undeclared_actions(magic: str) -> list:
    """The parser's arguments that no declaration made (``-o/--output`` of ``%%distrain``)."""
    from distnb import magics
    from distnb.core import options, plan

    parser = getattr(magics, MAGICS[magic][1]).parser
    declared = {flag for cls_name in MAGICS[magic][0]
                for f, opt in options.declared(getattr(plan, cls_name)) if opt.cli
                for flag in options.flags_of(f, opt)}
    return [a for a in parser._actions
            if a.option_strings and a.dest != "help" and not set(a.option_strings) & declared]


def _para(*parts) -> nodes.paragraph:
    para = nodes.paragraph()
    for part in parts:
        para += part
    return para


def _literals(words) -> list:
    out = []
    for i, word in enumerate(words):
        if i:
            out.append(nodes.Text(", "))
        out.append(nodes.literal(text=word))
    return out


class OptionsDirective(Directive):
    """``.. distnb-options:: MAGIC``: the declared options of ``%dist start`` or ``%%distrain``."""

    required_arguments = 1
    final_argument_whitespace = True

    def run(self):
        magic = self.arguments[0].strip()
        if magic not in MAGICS:
            raise self.error(f"distnb-options: unknown magic {magic!r}; known: {', '.join(MAGICS)}")
        items = nodes.definition_list()
        for row in option_rows(magic):
            term = nodes.term()
            term["ids"].append(row["id"])
            term += _literals(row["flags"] or ("(Python only) " + row["keyword"],))
            facts = [nodes.strong(text="type: "), nodes.Text(row["kind"]),
                     nodes.Text("; "), nodes.strong(text="default: "), nodes.Text(row["default"]),
                     nodes.Text("; "), nodes.strong(text="carries between cells: "),
                     nodes.Text(row["carries"])]
            if row["keyword"]:
                facts += [nodes.Text("; "), nodes.strong(text="Python keyword: "), nodes.literal(text=row["keyword"])]
            else:
                facts += [nodes.Text("; magic only")]
            body = nodes.definition()
            body += _para(*facts)
            body += _parse_rst(self, row["help"])
            items += nodes.definition_list_item("", term, body)
        out = [items]
        extra = undeclared_actions(magic)
        if extra:
            more = nodes.definition_list()
            for action in extra:
                term = nodes.term()
                term["ids"].append(_anchor(magic, action.dest))
                term += _literals(action.option_strings)
                body = nodes.definition()
                body += _para(nodes.strong(text="magic only: "), nodes.Text((action.help or "").replace("%%", "%")))
                more += nodes.definition_list_item("", term, body)
            out += [_para(nodes.Text(f"Arguments of {magic} beside the declared options:")), more]
        return out


def _parse_rst(directive, text: str) -> list:
    """``text`` (the declarations' help and docs are reStructuredText, as in the API's docstrings) as nodes."""
    from docutils.statemachine import StringList

    holder = nodes.container()
    directive.state.nested_parse(StringList(text.splitlines(), source="distnb declarations"),
                                 directive.content_offset, holder)
    return holder.children


class VerbsDirective(Directive):
    """``.. distnb-verbs::``: every magic and ``%dist`` verb, its docstring and its parser's help."""

    def run(self):
        from distnb import magics

        entries = [(f"%dist {verb}", fn) for verb, fn in magics.VERBS.items()]
        entries += [("%%dist", magics._cell), ("%%distrain", magics._distrain)]
        out = []
        for title, fn in entries:
            section = nodes.section(ids=[re.sub(r"[^a-z0-9]+", "-", "magic " + title.lower()).strip("-")])
            section += nodes.title(text=title)
            # IPython's magic_arguments parser: usage, the docstring, then every argument with its help
            section += nodes.literal_block(text=fn.parser.format_help().replace("usage: ", "", 1).removeprefix("::\n\n"))
            out.append(section)
        return out


def setup(app):
    app.add_directive("distnb-options", OptionsDirective)
    app.add_directive("distnb-verbs", VerbsDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
