"""The GPU review's findings 8, 10 and 14 on the real 2-rank gloo cluster (tests/gpu/REVIEW-ANSWERS.md).

- 8: a step reads its loss once (``check_loss``: ``--nan stop`` needs it before the update); the
  progress report, the epoch mean and validation (its sums stay on the device) read nothing more. Counted on the ranks with a tensor
  subclass whose every host read (``item``, ``float``, ``tolist``, ...) is recorded.
- 10: a rank's peak memory is the cell's, not the process's lifetime.
- 14: a whole cycle (start was done by the fixture, then train, pull, validate) never asks for CUDA in
  the kernel: ``torch.cuda._lazy_init`` (what makes a context) is never called.
"""

import torch
import torch.nn.functional as F

from support.data import parity_data, parity_model

COUNTED = '''
import torch
READS = {"item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu"}
_reads = []

class Counted(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            _reads.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})
'''


def test_a_step_reads_its_loss_once(shell, dist_session):
    s = dist_session
    ns = shell.user_ns
    ns["reads_net"], ns["reads_data"], ns["F"] = parity_model(), parity_data(n=128), F
    ns["reads_val"] = parity_data(n=64, seed=3)
    s.run(COUNTED)
    body = "x, y = batch\nloss = F.cross_entropy(model(x), y).as_subclass(Counted)"
    r = s.train(body, model="reads_net", data="reads_data", val_data="reads_val", epochs=2, batch_size=16,
                optimizer="sgd", lr=0.05, progress="none", quiet=True)  # validation sums on the device: no read
    steps = r.rows[0]["steps"]
    reads = s.pull("_reads")
    assert steps == 8 and all(len(x) == steps for x in reads), (steps, [sorted(set(x)) for x in reads], reads)


def test_the_ranks_peak_memory_is_the_cell_s(shell, dist_session):
    s = dist_session
    ns = shell.user_ns
    ns["peak_net"], ns["peak_data"], ns["F"] = parity_model(), parity_data(n=64), F
    opts = dict(model="peak_net", data="peak_data", epochs=1, batch_size=16, optimizer="sgd", lr=0.05,
                progress="none", quiet=True)
    big = "x, y = batch\n_big = torch.ones(80 << 20) if ctx.step == 0 else None\nloss = F.cross_entropy(model(x), y)"
    s.train(big, **opts)  # 320 MiB touched at its first step
    read = "from distnb.engine.transport.report import peak_memory\n_peak = peak_memory(device)"
    s.run("_big = None\n" + read)
    first = s.pull("_peak")
    s.train("x, y = batch\nloss = F.cross_entropy(model(x), y)", **opts)
    s.run(read)
    second = s.pull("_peak")
    assert all(k == "rss" for _, k in first + second), (first, second)
    assert all(a - b > 200 << 20 for (a, _), (b, _) in zip(first, second)), (first, second)


def test_the_kernel_never_initialises_cuda(shell, dist_session, monkeypatch):
    calls = []
    real = torch.cuda._lazy_init

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(torch.cuda, "_lazy_init", spy)
    ns = shell.user_ns
    ns["ctx_net"], ns["ctx_data"], ns["ctx_val"], ns["F"] = (parity_model(), parity_data(n=64),
                                                             parity_data(n=32, seed=3), F)
    result = shell.run_cell("%%distrain --model ctx_net --data ctx_data --val-data ctx_val --epochs 1 "
                            "--batch-size 16 --progress none\nx, y = batch\nloss = F.cross_entropy(model(x), y)")
    assert result.success, result.error_in_exec
    dist_session.pull("rank")
    assert calls == [] and not torch.cuda.is_initialized()
