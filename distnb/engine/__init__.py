"""Code that runs inside the engines (the ranks).

Import rule, checked by a test: nothing here imports IPython or distnb's kernel-side
modules (magics, session, cluster, display, transfer); only torch, the standard
library, :mod:`distnb.core.plan` and :mod:`distnb.core.errors`.
"""
