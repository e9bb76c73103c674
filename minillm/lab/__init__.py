"""minillm's classroom labs: write parts of the engine yourself, graded by the engine's own tests.

    python -m minillm.lab list              # the exercises, one per rung
    python -m minillm.lab start 03          # labwork/03/block_manager.py, bodies to write
    python -m minillm.lab check 03          # grade it: invariants and tokens vs Hugging Face
    python -m minillm.lab answers           # the teacher's key to the notebooks' questions
    python -m minillm.lab grade --class D   # teacher: grade one folder per student
    python -m minillm.lab handout OUT       # teacher: the students' repository

In a notebook, ``from minillm import lab; lab.check("01.q3a", answer)`` checks a numeric answer.
The teacher's guide is ``docs/TEACHING.md``.
"""
from __future__ import annotations

from .questions import QUESTIONS, check, is_right

__all__ = ["check", "is_right", "QUESTIONS"]
