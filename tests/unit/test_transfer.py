import numpy as np
import pytest
import torch
import torch.nn as nn

from distnb.engine.transport import stateout, wire
from distnb.core.errors import PlanError
from distnb.engine.transport.wire import pack
from distnb.transfer.transfer import columns_of, fingerprint, free_names


class Tied(nn.Module):
    """Defined in a test module; cloudpickle sends test-module classes by reference, __main__ ones by value."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("steps", torch.tensor(7))


def test_pack_round_trip_keeps_values_params_and_ties():
    m = Tied()
    payload, descs, buffers = pack(m)
    assert len(payload) < 4096  # weights are not in the pickle
    assert len(descs) == len(buffers) == 2  # the tied weight travels once
    m2 = wire.loads(payload, descs, buffers)
    assert m2.out.weight is m2.emb.weight
    assert isinstance(m2.emb.weight, nn.Parameter) and m2.emb.weight.requires_grad
    assert torch.equal(m2.emb.weight, m.emb.weight) and m2.steps.item() == 7
    m2.emb.weight.data.add_(1)  # the copy is writable and independent
    assert not torch.equal(m2.emb.weight, m.emb.weight)


def test_pack_buffers_are_zero_copy_views():
    t = torch.arange(10, dtype=torch.float32)
    _, _, (buf,) = pack({"t": t})
    assert buf.ctypes.data == t.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16])
def test_every_dtype_survives(dtype):
    t = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    keys, descs, sizes, flat = stateout.flatten_state({"a": t, "b": t[0].clone()})
    back = wire.unflatten_state(keys, descs, sizes, flat)
    assert torch.equal(back["a"], t) and back["a"].dtype == dtype and back["b"].shape == (4,)


def test_columns_of_accepts_the_documented_types():
    x, y = torch.randn(10, 3), torch.arange(10)
    assert columns_of(torch.utils.data.TensorDataset(x, y))[0] == ("tuple", 2, "TensorDataset")  # one on the ranks
    assert columns_of([x, y])[0] == ("tuple", 2) and columns_of(list(zip(x, y)))[0] == ("tuple", 2)
    assert columns_of((x.numpy(), y.numpy()))[2] == 10
    assert columns_of(x)[0] == ("tensor",)
    assert columns_of({"x": x, "y": y})[0] == ("dict", ("x", "y"))

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.full((2,), float(i)), i

    structure, cols, n = columns_of(DS())
    assert structure == ("tuple", 2, "TensorDataset") and n == 4 and cols[0][3].tolist() == [3.0, 3.0]


def test_is_columns_is_a_container_of_tensors_or_arrays_only():
    from distnb.transfer.transfer import is_columns

    x = torch.zeros(3, 2)
    for yes in ((x, x.numpy()), [x], {"a": x, "b": x.numpy()}):
        assert is_columns(yes)
    for no in ((), [], {}, (x, 1), [(x, 1)], {"a": 1}, x, torch.utils.data.TensorDataset(x), "ab"):
        assert not is_columns(no)


@pytest.mark.parametrize("bad,msg", [
    ([1, 2, 3], "tensors or numpy arrays"), ((torch.zeros(3), torch.zeros(4)), "different numbers"),
    (torch.zeros(0, 3), "empty"), ("text", "--data takes"), (torch.tensor(1.0), "0-d"),
])
def test_columns_of_rejects_bad_data_clearly(bad, msg):
    with pytest.raises(PlanError, match=msg):
        columns_of(bad, "train")


def test_fingerprint_follows_in_place_changes():
    m = nn.Linear(2, 2)
    fp = fingerprint(m)
    assert fingerprint(m) == fp
    with torch.no_grad():
        m.weight.add_(1)
    assert fingerprint(m) != fp
    assert fingerprint(nn.Linear(2, 2)) != fingerprint(m)
    for change in (lambda: setattr(m.weight, "data", torch.zeros(2, 2)),  # new memory, no version bump
                   lambda: m.double(),  # another dtype, through .data too
                   lambda: nn.utils.vector_to_parameters(torch.zeros(6, dtype=torch.float64), m.parameters())):
        fp = fingerprint(m)
        change()
        assert fingerprint(m) != fp


def test_free_names():
    code = "import math\nx, y = batch\nloss = lossfn(model(x), y) * scale + len(x)\ndef f(a): return a + k\n"
    assert free_names(code) == {"batch", "lossfn", "model", "scale", "k"}
    with pytest.raises(SyntaxError):
        free_names("x = (")


def test_numpy_columns_are_not_copied():
    a = np.arange(12, dtype=np.float32).reshape(6, 2)
    _, cols, _ = columns_of(a)
    assert cols[0].data_ptr() == a.ctypes.data


def test_fingerprint_sees_numpy_dict_and_attribute_changes():
    a = np.ones((4, 2), dtype=np.float32)
    fp = fingerprint((a,))
    a *= 0
    assert fingerprint((a,)) != fp
    d = {"x": torch.ones(3)}
    fp = fingerprint(d)
    d["x"] = d["x"] * 0
    assert fingerprint(d) != fp
    m = nn.Sequential(nn.Linear(2, 2))
    m.scale = 2.0
    fp = fingerprint(m)
    assert fingerprint(m) == fp
    m.scale = 0.0
    assert fingerprint(m) != fp
    m[0].some_setting = "on"
    assert fingerprint(m) != fp



def test_a_new_tuple_of_the_same_columns_is_the_same_data():
    X, y = torch.ones(6, 2), torch.arange(6)
    fp = fingerprint((X, y))
    assert fingerprint((X, y)) == fingerprint(tuple([X, y])) == fp  # train(data=(X, y)) at every call: no re-scatter
    assert fingerprint([X, y]) != fp and fingerprint({"x": X, "y": y}) == fingerprint({"x": X, "y": y})
    assert fingerprint((X, y.clone())) != fp and fingerprint((y, X)) != fp
    X.mul_(2)
    assert fingerprint((X, y)) != fp
    samples = [(X[0], y[0])]  # not columns: still the list object's identity
    assert fingerprint(samples) != fingerprint(list(samples))


def test_free_names_are_parsed_once_and_still_fresh():
    from distnb.transfer.transfer import _unassigned

    code = "x, y = batch\nloss = F.cross_entropy(model(x), y)\nprint(len(x))"
    assert free_names(code) == {"batch", "F", "model"}
    before = _unassigned.cache_info().hits
    names = free_names(code)
    names.add("changed")  # the caller's own set
    assert free_names(code) == {"batch", "F", "model"} and _unassigned.cache_info().hits == before + 2
    with pytest.raises(SyntaxError):
        free_names("x = (")
    with pytest.raises(SyntaxError):
        free_names("x = (")

def test_freezing_a_parameter_changes_the_fingerprint():
    import torch.nn as nn

    from distnb.transfer.transfer import fingerprint

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    before = fingerprint(net)
    net[0].weight.requires_grad_(False)
    assert fingerprint(net) != before


def test_the_part_that_cannot_be_pickled_is_found_by_its_path():
    import threading

    import pytest

    from distnb.core.errors import PlanError
    from distnb.transfer.transfer import pack_named, unpicklable_part

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    assert unpicklable_part(net, "net") is None
    net[1].lock = threading.Lock()
    path, obj, exc = unpicklable_part(net, "net")
    assert path == "net.1.lock" and type(obj).__name__ == "lock" and isinstance(exc, TypeError)
    with pytest.raises(PlanError, match=r"'net' \(Sequential\) .*net\.1\.lock is a lock.* give ReLU a __getstate__"):
        pack_named("net", net)
    box = {"files": [1, (x for x in ())]}
    assert unpicklable_part(box, "box")[0] == "box['files'][1]"


def test_a_changed_model_is_described_by_what_changed():
    from distnb.transfer.transfer import model_change

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    keys = list(net.state_dict().keys())
    before = fingerprint(net)
    net.train()
    net(torch.randn(4, 2))  # train mode in the kernel: BatchNorm's statistics move
    assert "1 running statistics (BatchNorm run in train mode)" in model_change(before, fingerprint(net), keys)
    before = fingerprint(net)
    with torch.no_grad():
        net[0].weight.mul_(2)
    assert model_change(before, fingerprint(net), keys) == "0.weight changed"
    before = fingerprint(net)
    net[0].bias.requires_grad_(False)
    assert model_change(before, fingerprint(net), keys) == "which parameters train changed"
    assert model_change(before, fingerprint(torch.nn.Linear(2, 2)), keys) == "it is a new object"


def test_the_notebook_globals_a_model_reads_are_in_its_fingerprint():
    import types

    import torch.nn as nn

    from distnb.transfer import captured

    nb = types.ModuleType("__main__")  # a notebook's namespace: its classes and functions go by value
    exec("import torch.nn as nn\nTEMP = 1.0\nCFG = {'k': 2}\ndef helper(z):\n    return z / TEMP\n"
         "class Base(nn.Module):\n    @staticmethod\n    def act(z):\n        return z * CFG['k']\n"
         "class Net(Base):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(2, 2)\n"
         "    def forward(self, x):\n        return self.act(helper(self.fc(x)))\n", nb.__dict__)
    net = nb.Net()
    assert captured.by_value(nb.Net) and not captured.by_value(nn.Linear)
    fp = fingerprint(net)
    assert fingerprint(net) == fp
    for change in ("TEMP = 2.0", "CFG['k'] = 3", "def helper(z):\n    return z * TEMP"):  # read through a base
        exec(change, nb.__dict__)                                                    # class and a function too
        assert fingerprint(net) != fp, change
        fp = fingerprint(net)
    exec("UNUSED = 5", nb.__dict__)  # a global the model's code does not read
    assert fingerprint(net) == fp


def test_a_models_attributes_and_hooks_are_in_its_fingerprint():
    import types

    from distnb.transfer.transfer import model_change

    nb = types.ModuleType("__main__")
    exec("import torch, torch.nn as nn\nclass M(nn.Module):\n    SCALE = 1.0\n    def __init__(self):\n"
         "        super().__init__()\n        self.fc = nn.Linear(2, 2)\n        self.act = torch.relu\n"
         "        self.cfg = {'scale': 1.0, 'sizes': [1, 2]}\n"
         "    def forward(self, x):\n        self.last = x\n        return self.act(self.fc(x)) * self.SCALE\n", nb.__dict__)
    net = nb.M()
    keys = list(net.state_dict())
    fp = fingerprint(net)
    net(torch.randn(3, 2))  # a forward that caches a tensor in an attribute: no change
    assert fingerprint(net) == fp
    for change, says in (("net.act = torch.tanh", "the model's attribute act changed"),
                         ("net.cfg['sizes'][0] = 5", "the model's attribute cfg changed"),
                         ("h = net.fc.register_forward_hook(lambda m, i, o: o)", "a forward hook on fc was added"),
                         ("h.remove()", "a forward hook on fc"),
                         ("net.register_forward_pre_hook(lambda m, i: None)", "a forward pre-hook on the model"),
                         ("M.SCALE = 2.0", "class attribute its code reads changed")):
        exec(change, {"net": net, "torch": torch, "M": nb.M, **globals()}, nb.__dict__)
        after = fingerprint(net)
        assert after != fp and says in model_change(fp, after, keys), change
        fp = after
    net.eval()  # the mode is the cell's business, not a change
    assert fingerprint(net) == fp


def test_a_parametrized_model_round_trips_exactly():
    from torch.nn.utils import parametrizations

    from distnb.engine.transport import wire

    torch.manual_seed(0)
    net = nn.Sequential(parametrizations.weight_norm(nn.Linear(5, 6)), nn.Tanh(),
                        parametrizations.spectral_norm(nn.Linear(6, 3)), parametrizations.orthogonal(nn.Linear(3, 3)))
    net.eval()
    got = wire.loads(*wire.pack(net))
    got.eval()
    x = torch.randn(4, 5)
    assert torch.equal(got(x), net(x)) and list(got.state_dict()) == list(net.state_dict())
    assert type(got[0]).__name__ == "ParametrizedLinear"
    got.train()
    got(x).sum().backward()
    assert got[0].parametrizations.weight.original0.grad is not None


def test_a_dataset_read_whole_names_the_index_whose_getitem_raised():
    from distnb.core.errors import PlanError

    class Val(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            if i == 13:
                raise ValueError("record 13 is corrupt")
            return torch.ones(2), i

    with pytest.raises(PlanError, match=r"val\[13\] raised ValueError: record 13 is corrupt; fix the Dataset's "
                                        r"__getitem__ for index 13"):
        columns_of(Val(), "val")


def test_every_attribute_that_changed_is_named_up_to_four():
    from distnb.transfer.transfer import model_change

    net = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    net.cfg, net[1].mode = {"scale": 1.0}, "a"
    keys, before = list(net.state_dict()), fingerprint(net)
    net.cfg["scale"], net[1].mode = 3.0, "b"  # it named only the first
    assert model_change(before, fingerprint(net), keys) == "the model's attribute cfg changed, 1's attribute mode changed"



NB_MODEL = ("import functools, torch, torch.nn as nn\nTEMP = 1.0\n"
            "def helper(z, k=2.0):\n    return z / TEMP * k\n"
            "def scaled(factor):\n    def deco(f):\n        @functools.wraps(f)\n        def wrapper(*a):\n"
            "            return f(*a) * factor\n        return wrapper\n    return deco\n"
            "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(2, 2)\n"
            "    @scaled(1.0)\n    def forward(self, x):\n        return self.act(helper(self.fc(x)))\n"
            "    @staticmethod\n    def act(z):\n        return torch.relu(z)\n"
            "    @property\n    def width(self):\n        return 2\n"
            "    @torch.no_grad()\n    def probe(self, x):\n        return self.fc(x)\n")


def _notebook(source):
    import types

    nb = types.ModuleType("__main__")  # a notebook's namespace: its classes and functions go by value
    exec(source, nb.__dict__)
    return nb


@pytest.mark.parametrize("change, says", [
    ("Net.forward = lambda self, x: self.act(helper(self.fc(x)))", "Net.forward"),  # same globals, new code
    ("def forward(self, x):\n    return self.act(helper(self.fc(x))) * 2\nNet.forward = forward", "Net.forward"),
    ("Net.forward = scaled(2.0)(Net.forward.__wrapped__)", "Net.forward"),  # the decorator's closure
    ("Net.forward = Net.forward.__wrapped__", "Net.forward"),  # the decorator removed
    ("Net.forward.__wrapped__.__code__ = (lambda self, x: self.fc(x)).__code__", "Net.forward"),  # wrapped code
    ("Net.act = staticmethod(lambda z: torch.tanh(z))", "Net.act"),
    ("Net.act = classmethod(lambda cls, z: torch.relu(z))", "Net.act"),
    ("Net.width = property(lambda self: 3)", "Net.width"),
    ("Net.probe = torch.no_grad()(lambda self, x: self.fc(x) * 2)", "Net.probe"),
    ("Net.probe = torch.enable_grad()(Net.probe.__wrapped__)", "Net.probe"),
    ("helper.__defaults__ = (3.0,)", "a notebook global, function or class attribute its code reads changed"),
    ("def helper(z, k=2.0):\n    return z * TEMP * k", "a notebook global, function or class attribute"),
    ("helper.__code__ = (lambda z, k=2.0: z - TEMP).__code__", "a notebook global, function or class attribute"),
])
def test_a_method_replaced_on_a_notebook_class_changes_the_fingerprint(change, says):
    from distnb.transfer.transfer import model_change

    nb = _notebook(NB_MODEL)
    net = nb.Net()
    keys = list(net.state_dict())
    before = fingerprint(net)
    exec(change, nb.__dict__)
    after = fingerprint(net)
    assert after != before, change
    assert says in model_change(before, after, keys), (change, model_change(before, after, keys))


def test_a_cell_run_again_from_the_same_source_is_no_change():
    # re-running the defining cell makes new function and class objects of the same code: the ranks' copies are
    # what the kernel's are, so the model (and its optimizer state) is not sent again
    from distnb.transfer import captured

    nb = _notebook(NB_MODEL)
    net = nb.Net()
    before, helper_fp = fingerprint(net), fingerprint(nb.helper)
    old = nb.Net
    exec(NB_MODEL, nb.__dict__)
    assert nb.Net is not old and fingerprint(net) == before
    assert captured.digest([nb.Net]) == captured.digest([old])
    assert fingerprint(nb.helper) == helper_fp  # a function the body calls: not pushed again either
    nb.helper.__defaults__ = (5.0,)  # ... but changed in place, it is
    assert fingerprint(nb.helper) != helper_fp


def test_a_function_option_or_body_function_changed_in_place_is_a_change():
    # --lr-schedule/--metric style functions and the functions a body calls: code, closure cells, defaults,
    # a partial's arguments and a settings object they read count; export's name check sees the same
    from distnb.train.jobfiles import name_digest

    nb = _notebook("import functools, types\nCFG = types.SimpleNamespace(warm=10)\n"
                   "def make(k):\n    def sched(opt, total, lo=0.1):\n        return (k, lo, CFG.warm, total)\n"
                   "    return sched\nsched = make(2)\npart = functools.partial(make(1), lo=0.2)\n")
    for name, change in (("sched", "sched.__defaults__ = (0.5,)"), ("sched", "sched.__closure__[0].cell_contents = 3"),
                         ("sched", "CFG.warm = 20"), ("part", "part = functools.partial(part.func, lo=0.3)"),
                         ("sched", "sched.__code__ = sched.__code__.replace(co_names=('CFG', 'cold'))")):
        before, named = fingerprint(nb.__dict__[name]), name_digest(nb.__dict__[name])
        exec(change, nb.__dict__)
        assert fingerprint(nb.__dict__[name]) != before or name == "part", change
        assert name_digest(nb.__dict__[name]) != named, change


def test_notebook_code_put_into_a_library_class_is_named():
    # nn.Linear travels by reference: the ranks import torch's own and never see the notebook's replacement
    from distnb.transfer import captured

    nb = _notebook(NB_MODEL + "def doubled(self, x):\n    return torch.nn.functional.linear(x, self.weight) * 2\n")
    net = nb.Net()
    assert captured.library_patches(net) == []
    original = nn.Linear.forward
    try:
        nn.Linear.forward = nb.doubled
        assert captured.library_patches(net) == ["torch.nn.Linear.forward"]
        assert "the ranks compute without the replacement: subclass the class in the notebook" in \
            captured.library_patch_warning("net", net)
    finally:
        nn.Linear.forward = original
    assert captured.library_patches(net) == []


def test_a_base_class_method_replaced_is_named_as_the_base_s():
    from distnb.transfer.transfer import model_change

    nb = _notebook("import torch.nn as nn\nclass Base(nn.Module):\n    def forward(self, x):\n        return self.fc(x)\n"
                   "class Child(Base):\n    def __init__(self):\n        super().__init__()\n"
                   "        self.fc = nn.Linear(2, 2)\n    def forward(self, x):\n        return super().forward(x)\n")
    net = nb.Child()
    before = fingerprint(net)
    exec("Base.forward = lambda self, x: self.fc(x) * 2", nb.__dict__)
    assert "the code of Base.forward changed" in model_change(before, fingerprint(net), list(net.state_dict()))
