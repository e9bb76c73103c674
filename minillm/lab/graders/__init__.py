"""One grader per exercise (``test_<id>.py``), run by ``python -m minillm.lab check <id>``.

Graders test behaviour only: invariants under random operations (hypothesis), token equality
with Hugging Face ``generate``, and the contract each function's docstring states. The tests of
the package import their helpers (``check_block_invariants``…), so the engine and the students
are held to the same checks.
"""
