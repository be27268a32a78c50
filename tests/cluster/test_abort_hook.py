"""A rank's pending DDP all-reduce ends as soon as another rank's failure is announced (engine/abort.py).

gloo does not end every operation when its connections are shut: one whose data was on its way
waits out the group's timeout. DDP's backward therefore waits on a future of distnb's own
(``abort.ddp_allreduce_hook``), which ``abort.end_pending`` fails at once. Here, on the real
2-rank group, rank 0 starts the hook's all-reduce that rank 1 has not joined, the failure of
rank 1 is recorded as ``poll`` records it, and the future must fail at once with an error that
names rank 1; rank 1 then joins (the same hook, so not through the cell's checked collectives), so the group stays consistent for the next cell.
"""

CODE = """
import torch, torch.distributed as dist
from distnb.engine.process import abort

class Bucket:  # what DDP hands a comm hook: the flat gradients of one bucket
    def __init__(self, tensor):
        self.tensor = tensor
    def buffer(self):
        return self.tensor

store = dist.distributed_c10d._get_default_store()
tensor = torch.ones(4) * (rank + 1)
if rank == 0:
    fut = abort.ddp_allreduce_hook(None, Bucket(tensor))
    waited = not fut.done()  # rank 1 has not joined: the all-reduce waits
    abort.ARMED.by = 1  # what poll() records when rank 1's failure is announced
    ended = abort.end_pending()
    try:
        fut.wait()
        error = None
    except Exception as exc:
        error = str(exc)
    named = str(abort.consequence(RuntimeError(error or ""), 0))
    abort.ARMED.by = None
    store.set("test-abort-hook", "1")
    outcome = (waited, ended, error is not None and "Connection closed by peer" in error, named)
else:
    store.wait(["test-abort-hook"])
    abort.ddp_allreduce_hook(None, Bucket(tensor)).wait()  # the all-reduce rank 0 started: the group stays in step
    outcome = None
dist.barrier()
outcome
"""


def test_a_pending_ddp_allreduce_ends_when_a_failure_is_announced(dist_session):
    waited, ended, closed, named = eval(dist_session.run(CODE)[0])
    assert waited and ended == 1 and closed
    assert named == "rank 0 stopped because rank 1 failed: its pending collective was ended at once"
    assert dist_session.run("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                            "t.item()") == ["2.0", "2.0"]  # the group works on
