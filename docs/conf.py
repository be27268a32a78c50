"""Sphinx configuration of distnb's documentation (``make docs``; ``tests/docs`` builds it with ``-W -n``).

Guides and pages are MyST markdown; the notebooks are rendered by myst-nb from their stored
outputs (never executed here); the reference is generated from distnb's option declarations by
``_ext/distnb_reference.py`` and from its numpydoc docstrings by autodoc + napoleon.
"""

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the checkout's distnb, not another installed copy
sys.path.insert(0, str(HERE / "_ext"))

project = "distnb"
author = "the distnb developers"
copyright = "the distnb developers, BSD-3-Clause"
release = version = "0.1.0"

extensions = [
    "myst_nb",  # MyST markdown and .ipynb pages (it loads myst_parser itself)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "distnb_reference",
]

# The notebooks are tests too (nbval runs them with their stored outputs): render those outputs.
nb_execution_mode = "off"
# notebooks/ is a symlink to the repository's notebooks/, where nbval runs them (rendered, never copied).
exclude_patterns = ["_build", "notebooks/.ipynb_checkpoints"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # guides link to their own sections by heading text

napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# numpydoc types such as "{'stop', 'restart'}, optional" become literals and words, not references
napoleon_preprocess_types = True
# an "Attributes" section is a field list of the class (several of Context's are also properties,
# documented as members: as attribute entries they would be described twice)
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}

# A stale cross-reference fails the build (tests/docs runs sphinx-build -W -n).
nitpicky = True
# No network here and no cached inventory of torch's docs, so intersphinx cannot resolve torch's
# names (torch.nn.Module, torch.Tensor, ... in numpydoc types): those, and only those, are let through.
nitpick_ignore_regex = [(r"py:.*", r"torch(\..*)?")]

html_theme = "furo"
html_title = "distnb"
html_static_path = ["_static"]

# numpydoc types that name a documented class by its short name (module paths: today's layout)
napoleon_type_aliases = {
    "TrainResult": ":class:`~distnb.train.results.TrainResult`",
    "Session": ":class:`~distnb.session.Session`",
    "ClusterSpec": ":class:`~distnb.core.plan.ClusterSpec`",
    "TrainPlan": ":class:`~distnb.core.plan.TrainPlan`",
    "StatusTable": ":class:`~distnb.train.results.StatusTable`",
    "WhereTable": ":class:`~distnb.train.results.WhereTable`",
}

# Option flags in prose (the declarations' help: "--data names a Dataset") must keep their two
# hyphens; docutils' smart quotes would print them as an en dash, which a reader cannot paste.
smartquotes = False
