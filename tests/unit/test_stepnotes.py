"""What a finished cell says of how its steps were done (distnb.train.stepnotes), from made-up result rows."""

import types

from distnb.train import stepnotes


def plan(**kw):
    base = dict(accumulate=1, loop=False, precision="fp32")
    return types.SimpleNamespace(**{**base, **kw})


def rows(**first):
    return [dict(rank=0, steps_per_epoch=10, token_weighted=False, **first), dict(rank=1, steps_per_epoch=10)]


def test_a_short_last_group_is_said_and_an_even_one_is_not():
    assert stepnotes.short_group(plan(accumulate=4), rows()).startswith(
        "3 optimizer steps per epoch, the last of 2 micro-batches (--accumulate 4 over 10 micro-batches per rank")
    assert stepnotes.short_group(plan(accumulate=3), rows()).startswith("4 optimizer steps per epoch, the last of "
                                                                        "1 micro-batch ")
    assert stepnotes.short_group(plan(accumulate=5), rows()) == ""
    assert stepnotes.short_group(plan(accumulate=1), rows()) == ""


def test_skipped_steps_are_named_up_to_four_then_counted():
    skipped = [dict(step=s, micro_steps=[2 * s - 1, 2 * s], ranks=[1] if s % 2 else [0, 1]) for s in range(1, 7)]
    note = next(n for n in stepnotes.notes(rows(skipped=skipped), plan(accumulate=2)) if "--nan skip" in n)
    assert note.startswith("--nan skip dropped 6 optimizer steps whose loss was inf/NaN: optimizer step 1 of the "
                           "cell (micro-steps 1-2: on rank 1); optimizer step 2 of the cell (micro-steps 3-4: on "
                           "ranks 0-1)")
    assert ", and 2 more; no update was applied" in note and "optimizer step 5" not in note


def test_a_stop_request_names_the_lowest_asking_ranks_reason():
    agreed = dict(ranks=[1, 3], reason=None, asked_at=None, step=9)
    four = [dict(rank=r, stop_request=dict(agreed, reason=f"r{r}" if r in (1, 3) else None,
                                           asked_at=7 if r in (1, 3) else None)) for r in range(4)]
    assert stepnotes.stop_request(four) == dict(ranks=[1, 3], reason="r1", step=9, asked_at=7)
    note = stepnotes.notes(four, plan())[-1]
    assert note.startswith("stopped after global optimizer step 9 on every rank: ranks 1,3 asked to stop "
                           "(ctx.request_stop: r1)")


def test_a_request_that_came_as_the_cell_ended_is_said():
    late = [dict(rank=0), dict(rank=1, stop_asked=("done", 12))]
    assert stepnotes.notes(late, plan())[-1].startswith("rank 1 asked to stop (done) at global step 12, as the "
                                                        "cell was ending")


def test_precision_and_weighting_notes():
    assert any("without loss scaling" in n for n in stepnotes.notes(rows(), plan(precision="bf16")))
    fp16 = stepnotes.notes(rows(loss_scale=1024.0, scaler_skips=2), plan(precision="fp16"))
    assert "fp16 with a GradScaler: loss scale 1024 now; it skipped 2 optimizer steps" in fp16[0]
    assert stepnotes.convention_note(rows()) == stepnotes.CONVENTION
    assert stepnotes.convention_note([dict(token_weighted=True)]) == ""
    assert stepnotes.convention_note([dict(token_weighted=None)]) == ""  # a --loop body: nothing to say
