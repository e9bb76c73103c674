"""Run a grader with a student's files standing in for modules of the package.

Started as a *script* (``python .../_bootstrap.py GRADER MODULE=FILE ... -- PYTEST ARGS``) so that
nothing of ``minillm`` is imported before the stand-ins are installed: a finder at the front of
``sys.meta_path`` answers for each overridden module with the student's file, wherever in the
package it is first imported. Relative imports in the student's file resolve exactly as in the
original, because the module keeps its name.
"""
import importlib.abc
import importlib.util
import os
import sys


class StandIn(importlib.abc.MetaPathFinder):
    def __init__(self, files: dict):
        self.files = files

    def find_spec(self, name, path=None, target=None):
        if name in self.files:
            return importlib.util.spec_from_file_location(name, self.files[name])
        return None


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]        # this folder is not a place to import from
    split = argv.index("--") if "--" in argv else len(argv)
    grader, overrides, pytest_args = argv[0], argv[1:split], argv[split + 1:]
    files = dict(o.split("=", 1) for o in overrides)
    sys.meta_path.insert(0, StandIn(files))
    import pytest
    return pytest.main([grader, *pytest_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
