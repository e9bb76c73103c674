"""One grader per exercise (``test_<id>.py``), run by ``python -m minillm.lab check <id>``.

Graders test behaviour only: invariants under random operations (hypothesis), token equality
with Hugging Face ``generate``, and the contract each function's docstring states. Checks they share with the
package's tests live in ``minillm/lab/checks.py`` (``check_block_invariants``), and
``tests/lab/test_lab.py`` runs every grader on the package's own code, so the engine and the students
are held to the same checks.
"""
