"""What a finished training cell says of how its steps were done (kernel side).

From every rank's row of the result: the loss convention (token-weighted with ``ctx.num_items``,
else the mean per micro-batch), an epoch's short last accumulation group, each step ``--nan skip``
dropped with the ranks where the loss was not finite, the precision's loss scaling, and a stop a
rank asked for with ``ctx.request_stop``.
"""

from __future__ import annotations

from distnb.core.errors import ranks_named
from distnb.core.tables import count

#: What a cell without ``ctx.num_items`` says once of its loss.
CONVENTION = ("loss: the body's loss is taken as a mean per micro-batch, then averaged over micro-steps and ranks "
              "(every micro-batch weighs the same, whatever it holds); a body that sums its loss over tokens with "
              "padding masked can set `ctx.num_items = mask.sum()` for the token-weighted mean one process gets on "
              "the whole batch")

#: Steps named one by one before the rest are counted.
NAMED_SKIPS = 4


def stop_request(rows) -> dict | None:
    """``{"ranks", "reason", "step", "asked_at"}`` of a cell the ranks stopped on ``ctx.request_stop``, or None.

    ``reason`` and ``asked_at`` are the lowest requesting rank's (its own row holds them).
    """
    agreed = next((r["stop_request"] for r in rows if r.get("stop_request")), None)
    if agreed is None:
        return None
    first = agreed["ranks"][0]
    own = next((r["stop_request"] for r in rows if r.get("rank") == first and r.get("stop_request")), agreed)
    return dict(ranks=list(agreed["ranks"]), reason=own.get("reason"), step=agreed.get("step"),
                asked_at=own.get("asked_at"))


def short_group(plan, rows) -> str:
    """``"3 optimizer steps per epoch, the last of 2 micro-batches"`` when an epoch's last ``--accumulate`` group
    is short, else ``""``."""
    steps = rows[0].get("steps_per_epoch")
    if plan.accumulate <= 1 or not steps or plan.loop:
        return ""
    groups = -(-steps // plan.accumulate)
    last = steps - (groups - 1) * plan.accumulate
    if last == plan.accumulate:
        return ""
    return (f"{count(groups, 'optimizer step')} per epoch, the last of {_batches(last)} (--accumulate "
            f"{plan.accumulate} over {_batches(steps)} per rank; its gradient is the mean over the samples it holds)")


def _batches(n: int) -> str:
    return f"{n} micro-batch" if n == 1 else f"{n} micro-batches"


def _skips(rows) -> str:
    """The steps ``--nan skip`` dropped, each with its micro-steps and the ranks where the loss was inf/NaN."""
    skipped = rows[0].get("skipped") or []
    if not skipped:
        return ""
    named = []
    for s in skipped[:NAMED_SKIPS]:
        first, last = s["micro_steps"]
        micro = f"micro-step {last}" if first == last else f"micro-steps {first}-{last}"
        named.append(f"optimizer step {s['step']} of the cell ({micro}: on {ranks_named(s['ranks'])})")
    more = f", and {len(skipped) - NAMED_SKIPS} more" if len(skipped) > NAMED_SKIPS else ""
    return (f"--nan skip dropped {count(len(skipped), 'optimizer step')} whose loss was inf/NaN: "
            f"{'; '.join(named)}{more}; no update was applied for them")


def notes(rows, plan) -> list:
    """The sentences of this module, in order (empty ones left out)."""
    first = rows[0]
    found = []
    weighted = first.get("token_weighted")
    if weighted:
        found.append("loss: token-weighted (ctx.num_items): each optimizer step's gradient is the summed loss over "
                     "the count summed over its micro-steps and ranks, as one process on the whole batch; the "
                     "logged losses are sums over counts")
    found.append(short_group(plan, rows))
    found.append(_skips(rows))
    if plan.precision == "bf16":
        found.append("bf16 autocast runs without loss scaling (bf16 has fp32's exponent range); weights and "
                     "optimizer state stay fp32")
    elif plan.precision == "fp16" and first.get("loss_scale") is not None:
        skips = first.get("scaler_skips") or 0
        found.append(f"fp16 with a GradScaler: loss scale {first['loss_scale']:g} now"
                     + (f"; it skipped {count(skips, 'optimizer step')} with inf/NaN gradients (every rank alike) "
                        "and halved the scale each time" if skips else ""))
    request = stop_request(rows)
    if request is not None:
        found.append(_stop_text(request))
    else:
        late = [(r["rank"], r["stop_asked"]) for r in rows if r.get("stop_asked")]
        if late:
            rank, (reason, step) = late[0]
            found.append(f"rank {rank} asked to stop ({reason or 'no reason given'}) at global step {step}, as the "
                         "cell was ending: it had trained all its epochs")
    return [f for f in found if f]


def _stop_text(request) -> str:
    why = f": {request['reason']}" if request.get("reason") else ""
    return (f"stopped after global optimizer step {request['step']} on every rank: {ranks_named(request['ranks'])} "
            f"asked to stop (ctx.request_stop{why}); the weights and the position in the epoch are kept, and the "
            "next cell goes on from there")


def convention_note(rows) -> str:
    """The loss convention of a cell without ``ctx.num_items`` ("" for a token-weighted one or a --loop body)."""
    return CONVENTION if rows[0].get("token_weighted") is False else ""

