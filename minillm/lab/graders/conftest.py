"""Fixtures of the graders: the tiny random Llama (fp32, so token equality is exact)."""
from __future__ import annotations

import os

import pytest
import torch

# as the student's process does (minillm/lab/_child.py): OMP_NUM_THREADS where set, else two
_n = os.environ.get("OMP_NUM_THREADS", "")
torch.set_num_threads(int(_n) if _n.isdigit() and int(_n) > 0 else 2)


@pytest.fixture(scope="session")
def tiny():
    from minillm import load_model
    return load_model("tiny-llama", dtype=torch.float32)

# No example database in the student's folder, and reports without hypothesis' explain phase.
# Derandomized: the same code draws the same examples on every run, so a grade never changes
# between two runs (or between a student's machine and the teacher's).
from hypothesis import Phase, settings  # noqa: E402

settings.register_profile("lab", database=None, derandomize=True,
                          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
settings.load_profile("lab")


@pytest.fixture(scope="session")
def student():
    """The student's process (``minillm.lab.sandbox``): ``student.run(probe, *args)`` computes
    ``probe`` there, on the student's file, and returns its value here, where the test judges it."""
    from minillm.lab.sandbox import student_from_env
    s = student_from_env()
    yield s
    s.close()
