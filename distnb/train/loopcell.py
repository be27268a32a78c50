"""The notes a finished training cell prints, with those only a ``--loop`` body needs (kernel side).

A ``--loop`` body writes its own loop, so two things a step body cannot get wrong can go
unnoticed there: ``--epochs`` acts only through ``ctx.epochs()``, and the optimizer steps are
the body's own ``optimizer.step()`` calls (counted on the ranks by
:class:`distnb.engine.train.loopwatch.LoopWatch`). A step body gets one warning before it runs
(:func:`clip_warnings`): clipping gradients before distnb's backward clips nothing.
"""

from __future__ import annotations

import ast
import functools

from distnb.core.tables import count
from distnb.train.results import training_notes


def notes(first: dict, plan, given=(), started=True) -> list:
    """The sentences a finished cell prints: :func:`distnb.train.results.training_notes` and the ``--loop`` ones.

    Parameters
    ----------
    first : dict
        Rank 0's row of the result.
    plan : distnb.core.plan.TrainPlan
        The cell's plan.
    given : collection of str
        The TrainPlan options the cell gave explicitly (``epochs`` for ``--epochs 3``).
    started : bool
        Whether to include the notes on the cell's start (False: the progress view printed them).

    Returns
    -------
    list of str
    """
    return training_notes(first, started) + (loop_notes(first, plan, given) if plan.loop else [])


def loop_notes(first: dict, plan, given=()) -> list:
    """What a ``--loop`` cell did not do that its options or its name suggest (empty when it did all).

    Parameters
    ----------
    first : dict
        Rank 0's row of the result (``iterated_epochs``, ``optimizer_steps``, ``steps``).
    plan : distnb.core.plan.TrainPlan
    given : collection of str
        The TrainPlan options given explicitly.

    Returns
    -------
    list of str
        A note when ``--epochs`` was given but the body never iterated ``ctx.epochs()``, and one
        when the body reported steps but no optimizer stepped.
    """
    found = []
    if "epochs" in given and first.get("iterated_epochs") is False:
        found.append(f"--epochs {plan.epochs} was not used: the --loop body never iterated ctx.epochs(), so it ran "
                     f"only the passes it writes itself and {plan.model} stays at epoch {first['next_epoch']}; to "
                     f"run {count(plan.epochs, 'epoch')}, loop `for epoch in ctx.epochs():` around "
                     "`for batch in ctx.loader:`")
    if first.get("optimizer_steps") == 0 and first.get("steps"):
        found.append(f"the --loop body reported {count(first['steps'], 'step')} but no optimizer stepped "
                     "(torch.optim.Optimizer.step() was never called on the ranks): the weights changed only if "
                     "the body updated them itself; call optimizer.step() after loss.backward()")
    return found


@functools.lru_cache(maxsize=64)
def clip_warnings(code: str) -> tuple:
    """Sentences about a step body that clips gradients before distnb's backward (so it clips nothing).

    Parsed once per body text (:func:`distnb.train.training.body_warnings` asks at every cell; the parse and the
    two walks of the tree were about 0.2 ms of a warm cell's kernel time, issue 17).
    """

    try:
        tree = ast.parse(code)
    except SyntaxError:
        return ()
    deferred = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            deferred.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and id(node) not in deferred:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("clip_grad_norm_", "clip_grad_value_"):
                return (f"the step body calls {name} before distnb's backward, so it clips nothing: pass "
                        "--clip-grad-norm X (the norm over the whole model, every rank's part), or clip in "
                        "ctx.after_backward(lambda: ...), which runs once the gradients are complete",)
    return ()
