"""Helpers shared by the tests (not tests themselves): data and model makers, the single-process reference.

Imported as ``support`` (``from support.reference import reference``): tests/ is on ``sys.path``
because pytest's default ``prepend`` import mode puts the folder of tests/conftest.py there
(tests/ is not a package).
"""
