"""Exercise 01 — static batching: ``left_pad`` and ``hf_forward`` in ``padded.py``.

Graded by behaviour: any padding code that right-aligns the rows, masks the padding and counts
positions over real tokens only passes; then the static engine must produce exactly the tokens
Hugging Face ``generate`` produces for each request alone.

Every call of your functions happens in your process (``probe_*``, the ``student`` fixture); what
they return comes back here and is judged, with Hugging Face run here as the reference.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.engines.padded import left_pad
from minillm.lab.reference import assert_greedy_match, hf_greedy, random_prompts

OUTSIDE = True       # judged in the grading process on values from the student's (grade.py)
seqs = st.lists(st.lists(st.integers(1, 400), min_size=1, max_size=12), min_size=1, max_size=6)


def probe_left_pad(batch: list, pad: int) -> tuple:
    ids, mask = left_pad(batch, pad, "cpu")
    return ids, mask


@settings(max_examples=40, deadline=None)
@given(batch=seqs, pad=st.integers(0, 3))
def test_left_pad_right_aligns_rows_and_masks_the_padding(student, batch, pad):
    ids, mask = student.run(probe_left_pad, batch, pad)
    assert isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor), \
        "left_pad returns two tensors: input_ids and attention_mask"
    width = max(len(s) for s in batch)
    assert tuple(ids.shape) == tuple(mask.shape) == (len(batch), width), \
        f"input_ids and attention_mask must both be [rows, longest] = [{len(batch)}, {width}]"
    assert ids.dtype == torch.long, "input_ids must be integer token ids (torch.long)"
    for row, s in enumerate(batch):
        n = len(s)
        assert ids[row, width - n:].tolist() == s, \
            f"row {row}: the prompt must end in the last column (left padding)"
        assert ids[row, :width - n].tolist() == [pad] * (width - n), \
            f"row {row}: the columns before the prompt hold pad_id"
        assert mask[row].tolist() == [0] * (width - n) + [1] * n, \
            f"row {row}: the mask is 1 on real tokens and 0 on padding"


def probe_static_engine(prompts: list) -> list:
    from minillm import load_model
    tiny = load_model("tiny-llama", dtype=torch.float32)
    outs = LLM(tiny, engine="static", batch_size=5).generate(
        prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    return [[int(t) for t in o.token_ids] for o in outs]


def test_static_batch_equals_hf_generate(student, tiny):
    """Prompts of very different lengths in one padded batch: each row must compute what it would
    compute alone (mask hides the padding, positions count real tokens only)."""
    prompts = random_prompts(5, seed=11, lo=2, hi=40)
    outs = student.run(probe_static_engine, prompts)
    assert len(outs) == len(prompts), f"{len(outs)} outputs for {len(prompts)} prompts"
    for i, (p, tokens) in enumerate(zip(prompts, outs)):
        assert_greedy_match(tokens, hf_greedy(tiny, p, 8),
                            label=f"request {i} (prompt of {len(p)} tokens)")
