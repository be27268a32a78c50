"""One declaration per option: a dataclass field that carries its flag, help, kind and check (stdlib only).

An option of ``%%distrain`` or ``%dist start`` is declared once, as a field of
:class:`~distnb.core.plan.TrainPlan` or :class:`~distnb.core.plan.ClusterSpec` made with
:func:`option`. Everything else is derived from that field:

- validation and normalisation on construction (:func:`check_fields`), errors naming the flag;
- the magic's argparse arguments (:func:`distnb.magics.declared_arguments`) and its help;
- the Python keywords of ``Session.train`` and ``distnb.start`` (:func:`keywords`,
  :func:`signature`), and the options section of their docstrings (:func:`doc`);
- which options decide how a model is distributed (:func:`distribution_fields`).

Adding an option means adding its field and the code that uses it, nothing else.

Example::

    @dataclass(frozen=True)
    class Plan:
        epochs: int = option(1, "int", "epochs to run (default 1)", minimum=1)
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
import textwrap
from dataclasses import dataclass

from distnb.core.errors import PlanError

#: Option kinds and what each checks (None is accepted for every option whose default is None).
KINDS = ("int", "float", "flag", "choice", "name", "names", "path", "word", "hosts", "text", "duration")
#: ``given`` for an option whose value, when not given, is its field default.
FIELD_DEFAULT = object()


@dataclass(frozen=True)
class Option:
    """What a field declares about itself as an option.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`: how the value is checked and normalised, and parsed by the magic.
    help : str
        The magic's help text for it (also the docstring line of the Python keyword).
    flags : tuple of str
        The magic's flags; empty: ``--`` + the name with dashes. ``()`` with ``cli=False``.
    keyword : str or None
        The Python keyword, when it differs from the field name (``n`` for ``num_engines``).
    cli, api : bool
        Whether the magic takes it, whether the Python API takes it as a keyword.
    minimum : float or None
        ``int``: the least value; ``float``: values must be > 0 unless ``minimum`` is set
        (then >= minimum), or any finite value with ``signed=True``.
    maximum : float or None
        The greatest value (int and float).
    signed : bool
        ``float``: any finite value (``--target-loss``).
    choices : tuple
        ``choice``: the allowed values.
    strategy : str, tuple of str, or None
        The ``--strategy`` (or strategies) this option belongs to: a value other than the
        default with another strategy is an error, and the option is part of how a model is
        distributed (see :func:`strategies_of`).
    distribution : bool
        Part of how a model is distributed even without ``strategy`` (``--strategy`` itself,
        ``--find-unused-parameters``): see :func:`distribution_fields`.
    given : object
        What the magic and the Python keyword pass when the option is not given (None: "decide
        for me" for options the session resolves, such as ``-n``); the field default otherwise.
    label : str or None
        How errors name it when that is not the first flag (``num_engines (-n)``).
    doc : str
        The longer description for the Python API's docstring (default: ``help``).
    nullable : bool
        None is a valid value although the default is not (``launcher``: the profile's).
    group : str
        A group of related options (``placement``: where engines run).
    carry : bool
        Part of the ranks' live training state (``--optimizer``): a cell that leaves it out
        keeps the value of the model's last cell (see :func:`carried_fields`).
    """

    kind: str
    help: str
    flags: tuple = ()
    keyword: str | None = None
    cli: bool = True
    api: bool = True
    minimum: float | None = None
    maximum: float | None = None
    signed: bool = False
    choices: tuple = ()
    strategy: str | tuple | None = None
    distribution: bool = False
    given: object = FIELD_DEFAULT
    label: str | None = None
    doc: str = ""
    group: str = ""
    nullable: bool = False
    carry: bool = False


def option(default=dataclasses.MISSING, kind="text", help="", **declared):
    """A dataclass field declared as an option (see :class:`Option` for ``declared``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown option kind {kind!r}")
    return dataclasses.field(default=default, metadata={"option": Option(kind=kind, help=help, **declared)})


def declared(cls) -> list:
    """``(field, Option)`` for every option field of the dataclass ``cls``, in declaration order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def refuse_unknown(given, known, what: str) -> None:
    """Raise a PlanError naming the keywords of ``given`` that are not in ``known`` (and listing those)."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        near = {u: difflib.get_close_matches(u, list(known), n=1, cutoff=0.75) for u in unknown}
        meant = [f"{u}: did you mean {m[0]}?" for u, m in near.items() if m]
        raise PlanError(f"unknown {what} option(s) {', '.join(unknown)}" + (f" ({'; '.join(meant)})" if meant else "")
                        + f"; known: {', '.join(sorted(known))}")


def flags_of(f, opt: Option) -> tuple:
    """The magic's flags of a field (``--batch-size`` for ``batch_size``)."""
    return opt.flags or ("--" + f.name.replace("_", "-"),)


def label_of(f, opt: Option) -> str:
    """How an error names the option: its label, its long flag, or (not a magic option) its name."""
    key = (f, opt.label, opt.cli, opt.flags)  # each check of a plan names all of its options (issue 17: per cell)
    label = _LABELS.get(key)
    if label is None:
        label = _LABELS[key] = _label(f, opt)
    return label


_LABELS: dict = {}  # (field, label, cli, flags) -> label_of


def _label(f, opt: Option) -> str:
    if opt.label:
        return opt.label
    if not opt.cli:
        return f.name
    return next((x for x in flags_of(f, opt) if x.startswith("--")), flags_of(f, opt)[0])


def given_of(f, opt: Option):
    """The value passed when the option is not given."""
    return f.default if opt.given is FIELD_DEFAULT else opt.given


def api_default(f, opt: Option):
    """The Python keyword's default: None for an option that carries over between cells (:func:`carries`).

    None there means "left out": the model's last cell's value, the field's default at first
    (:func:`without_left_out`), so a signature never shows a value a cell may not get.
    """
    return None if carries(opt) else given_of(f, opt)


def without_left_out(cls, given: dict) -> dict:
    """``given`` without the carried options of ``cls`` passed as None (left out: carried, or the default)."""
    carried = {opt.keyword or f.name for f, opt in declared(cls) if carries(opt)}
    return {k: v for k, v in given.items() if v is not None or k not in carried}


def keywords(cls) -> dict:
    """Python keyword -> field name, for the options the API takes."""
    return {opt.keyword or f.name: f.name for f, opt in declared(cls) if opt.api}


def signature(*classes, first=(), last=()) -> inspect.Signature:
    """A keyword-only signature of the API options of ``classes`` between ``first`` and ``last``.

    ``first``/``last``: :class:`inspect.Parameter` objects (``code``, ``ns``, ...).
    """
    params = list(first)
    taken = {p.name for p in params}
    for cls in classes:
        for f, opt in declared(cls):
            name = opt.keyword or f.name
            if opt.api and name not in taken:  # required options are among ``first`` (positional)
                params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=api_default(f, opt)))
    return inspect.Signature(params + list(last))


_TYPES = {"int": "int", "float": "float", "flag": "bool", "name": "str", "names": "tuple of str", "path": "str",
          "word": "str", "hosts": "tuple of str", "text": "str",
          "duration": "float or str"}


def doc(*classes, internal=False, skip=()) -> str:
    """numpydoc lines for the options of ``classes`` (the API's; all of them with ``internal``), less ``skip``.

    Each is ``name : type`` (``, optional`` when None is its default) and its description.
    """
    lines = []
    for cls in classes:
        for f, opt in declared(cls):
            if not (opt.api or internal) or f.name in skip:
                continue
            kind = "{" + ", ".join(map(repr, opt.choices)) + "}" if opt.choices else _TYPES[opt.kind]
            text = opt.doc or opt.help
            if (given_of(f, opt) if internal else api_default(f, opt)) is None:
                kind += ", optional"
            if not internal and carries(opt) and given_of(f, opt) is not None and "at first" not in text:
                said = f"None (left out): the model's last cell's value, {given_of(f, opt)!r} at first"
                text = f"{text} {said}." if text.endswith(".") else f"{text}; {said}"
            name = f.name if internal else opt.keyword or f.name
            lines += [f"{name} : {kind}"] + textwrap.wrap(text, 92, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def strategies_of(opt: Option) -> tuple:
    """The strategies an option belongs to (empty: every strategy)."""
    if not opt.strategy:
        return ()
    return (opt.strategy,) if isinstance(opt.strategy, str) else tuple(opt.strategy)


def distribution_fields(cls) -> tuple:
    """Names of the fields that decide how a model is distributed, in declaration order."""
    return tuple(f.name for f, opt in declared(cls) if opt.distribution or opt.strategy)


def carries(opt: Option) -> bool:
    """Whether an option carries over between cells: declared ``carry``, or part of how a model is distributed."""
    return opt.carry or opt.distribution or bool(opt.strategy)


def carried_fields(cls) -> tuple:
    """Names of the fields that carry over between cells (:func:`carries`), in declaration order."""
    return tuple(f.name for f, opt in declared(cls) if carries(opt))


# checks -----------------------------------------------------------------------------------
def check_int(name, value, minimum, maximum=None):
    """PlanError naming ``name`` unless ``value`` is an int in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise PlanError(f"{name} must be at most {maximum}, got {value}")


def check_number(name, value, positive=True):
    """PlanError naming ``name`` unless ``value`` is a finite number (and > 0 when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlanError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise PlanError(f"{name} must be positive, got {value}")


def check_flags(**flags) -> None:
    """PlanError naming the first of ``flags`` (keyword -> value) that is not True or False."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise PlanError(f"{name} must be True or False, got {value!r}")


def check_path(name, value) -> str:
    """``value`` as a path string (a str or ``os.PathLike``), or a PlanError naming ``name``."""

    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        return os.fspath(value)
    raise PlanError(f"{name} must be a folder path (a str or pathlib.Path), got {value!r}")


#: Seconds per unit of a duration (``90s``, ``10m``, ``2h``, ``1d``; a bare number is seconds).
DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(label, value) -> float:
    """``value`` (seconds, or a string ``"90s"``, ``"10m"``, ``"1.5h"``, ``"1d"``) in seconds (float >= 0).

    Raises
    ------
    PlanError
        Naming ``label`` when ``value`` is negative, not finite, or not a number with one of those units.
    """
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", value.lower())
        if match is None:
            raise PlanError(f"{label} must be a duration such as 30s, 10m or 2h (a bare number is seconds), "
                            f"got {value!r}")
        value = float(match.group(1)) * DURATION_UNITS[match.group(2)]
    check_number(label, value, positive=False)
    if value < 0:
        raise PlanError(f"{label} must be 0 or more, got {value}")
    return float(value)


def _names(label, value):
    if isinstance(value, str):
        value = tuple(v.strip() for v in value.split(",") if v.strip())
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple) or not value or not all(
            isinstance(v, str) and all(part.isidentifier() or part.isdigit() for part in v.split(".")) for v in value):
        raise PlanError(f"{label} must be comma-separated submodule names like `layers.2,head`, got {value!r}")
    return value


def split_hosts(label, value):
    """``value`` (``\"a,b\"`` or a sequence) as a tuple of host names, or a PlanError naming ``label``."""
    if isinstance(value, str):
        value = tuple(h.strip() for h in value.split(","))
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, tuple) or not all(isinstance(h, str) and h.strip() for h in value):
        raise PlanError(f"{label} must be host names separated by commas, got {value!r}")
    return value


def _check_one(f, opt: Option, value):
    """The normalised value of one option, or a PlanError naming it."""
    label = label_of(f, opt)
    if value is None and (f.default is None or opt.nullable):
        return None
    kind = opt.kind
    if kind == "int":
        check_int(label, value, int(opt.minimum if opt.minimum is not None else 0),
                  None if opt.maximum is None else int(opt.maximum))
    elif kind == "float":
        check_number(label, value, positive=not opt.signed and opt.minimum is None)
        low, high = opt.minimum, opt.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            bound = (f"at least {low:g}" if high is None else f"at most {high:g}" if low is None
                     else f"between {low:g} and {high:g}")
            raise PlanError(f"{label} must be {bound}, got {value}")
        value = value + 0.0  # -0.0 (which passes ">= 0") as 0.0: it printed "lr set to -0"
    elif kind == "flag":
        check_flags(**{label: value})
    elif kind == "choice":
        if value not in opt.choices:
            raise PlanError(f"{label} must be one of {', '.join(opt.choices)}, got {value!r}")
    elif kind == "name":
        if not isinstance(value, str) or not value.isidentifier():
            got = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
            raise PlanError(f"{label} must name a variable in the notebook, got {got}")
    elif kind == "names":
        value = _names(label, value)
    elif kind == "path":
        if not isinstance(value, str) or not value:
            raise PlanError(f"{label} must be a folder path, got {value!r}")
        value = os.path.abspath(os.path.expanduser(value))
    elif kind == "word":
        if not isinstance(value, str) or not value.strip() or value != value.strip():
            raise PlanError(f"{label} must be a non-empty word, got {value!r}")
    elif kind == "hosts":
        value = split_hosts(label, value)
    elif kind == "duration":
        value = parse_duration(label, value)
    return value


def check_fields(obj) -> None:
    """Check and normalise every option field of the frozen dataclass ``obj`` in place.

    Then options that belong to another ``--strategy`` than ``obj.strategy`` (if it has one)
    are an error naming them.

    Raises
    ------
    PlanError
        Naming the first bad option and what it takes.
    """
    for f, opt in declared(type(obj)):
        value = _check_one(f, opt, getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)
    strategy = getattr(obj, "strategy", None)
    foreign = {}
    for f, opt in declared(type(obj)):
        owners = strategies_of(opt)
        if owners and strategy not in owners and getattr(obj, f.name) != f.default:
            foreign.setdefault(owners, []).append(label_of(f, opt))
    for owners, labels in foreign.items():
        owner = " or ".join(owners)
        what = f"{labels[0]} is a --strategy {owner} option" if len(labels) == 1 else \
            f"{', '.join(labels[:-1])} and {labels[-1]} are --strategy {owner} options"
        raise PlanError(f"{what} (this cell uses --strategy {strategy})")


def uncommented(line: str) -> str:
    """A magic's ``line`` without its trailing ``# comment``: IPython hands a line magic the whole line, comment
    included (``%dist start  # 2 ranks`` was "unrecognized arguments: # 2 ranks"). A ``#`` inside a word stays."""
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0]
