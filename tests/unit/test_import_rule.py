"""engine/ runs inside the ranks: it must not drag in the kernel side, and the kernel side must not import torch."""

import subprocess
import sys

ENGINE_MODULES = ["distnb.engine", "distnb.engine.runtime", "distnb.engine.loop", "distnb.engine.report",
                  "distnb.engine.shard", "distnb.engine.wire", "distnb.engine.checkpoint", "distnb.engine.strategies",
                  "distnb.engine.strategies.ddp", "distnb.engine.zygote"]
FORBIDDEN_IN_ENGINE = ["IPython", "distnb.magics", "distnb.session", "distnb.cluster", "distnb.display",
                       "distnb.transfer", "distnb.launchers", "distnb.placement", "distnb.defaults", "ipywidgets"]


def _modules_after(imports):
    code = "import sys\n" + "".join(f"import {m}\n" for m in imports) + "print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_engine_imports_no_kernel_side_module():
    loaded = _modules_after(ENGINE_MODULES)
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_ENGINE)]
    assert bad == []


def test_kernel_side_does_not_import_torch_at_import_time():
    loaded = _modules_after(["distnb", "distnb.magics", "distnb.session", "distnb.cluster", "distnb.display",
                             "distnb.zygote", "distnb.launchers", "distnb.placement", "distnb.defaults",
                             "distnb.tracebacks"])
    assert "torch" not in loaded
