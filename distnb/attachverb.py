"""``%dist attach``: its options and help (the verb table of :mod:`distnb.magics` names them), issue 38."""

from __future__ import annotations

from IPython.core.magic_arguments import argument, magic_arguments


@magic_arguments(name="dist attach")
@argument("world", nargs="?", default=None,
          help="the world to join: its id as the listing shows it (a unique prefix will do) or its record file; "
               "left out: the listing, or with --model the only live world, e.g. %%dist attach 1796586149")
@argument("--model", default=None, metavar="NAME",
          help="a notebook model of the same structure as the ranks' (its name): the trained weights go into it when "
               "the running training cell ends (at once when none runs) and the TrainResult is returned; later cells "
               "with --model NAME go on training the ranks' live model, e.g. %%dist attach --model net")
@argument("--timeout", type=float, default=10.0,
          help="seconds the world's controller has to answer (a client without the world's key never gets an "
               "answer: attach is then refused), e.g. %%dist attach ID --timeout 30")
def parser(line):
    """List your live distnb worlds, or join one from this kernel (a new kernel after the old one
    died, restarted or was culled, or a second notebook).

    With no world named: one row per world (notebook, ranks, strategy, the running training cell
    and its progress). ``%dist attach ID`` joins it: ``%dist status``, ``%dist where``, ``%dist wait``
    (the running cell's TrainResult), ``%dist stop-training``, ``%dist stop`` and the next
    ``%%distrain`` cells then work here as in the kernel that started it, and a running cell's
    dashboard resumes. Only the user who started a world can attach (its files are owner-only and
    its messages signed).

    Example::

        %dist attach                      # list the worlds
        %dist attach 1796586149-t5av      # join one
        r = %dist attach --model net      # the only one: wait for its cell, weights into net
        %dist wait                        # or: the running cell's TrainResult later
    """


def call(args, ns):
    """Run ``%dist attach`` with parsed ``args`` in the notebook namespace ``ns``; what the cell shows."""
    from distnb.attaching import attach  # loads ipyparallel, psutil: at first use, not when this module is imported
    from distnb.session import Session  # loads ipyparallel, psutil: at first use, not when this module is imported

    value = attach(args.world, model=args.model, ns=ns, timeout=args.timeout)
    return None if isinstance(value, Session) else value
