"""runtime/heap.py's ``gather`` and layers/linear.py's ``gather_packed``: the weight copies a
one-row decode streams, moved into one buffer that starts on a 2 MiB page (advised to be backed by
huge pages on Linux); same numbers, same products, the plain weights left where they are."""
from __future__ import annotations

import sys

import pytest
import torch

from minillm.layers.linear import Linear, TorchLinear, gather_packed
from minillm.layers.quant import get_quantized_kernel
from minillm.runtime import heap


def test_gather_copies_into_one_aligned_buffer():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randint(-127, 128, (7, 9), dtype=torch.int8),
               torch.randn(11, generator=g).to(torch.bfloat16), torch.zeros(0), torch.randn(64, 33)]
    moved = heap.gather(tensors)
    storages = {t.untyped_storage().data_ptr() for t in moved if t.numel()}
    assert len(storages) == 1, "one buffer"
    for old, new in zip(tensors, moved):
        assert new.dtype == old.dtype and new.shape == old.shape and torch.equal(new, old)
        assert new.data_ptr() % 64 == 0 and new.is_contiguous()
        assert new.data_ptr() != old.data_ptr() or not old.numel()
    starts = sorted(t.data_ptr() for t in moved if t.numel())
    assert starts[0] % heap.HUGE_PAGE == 0, "the first tensor starts the 2 MiB page"
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in moved)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "no two overlap"


def test_huge_pages_are_asked_for_on_linux_only_when_a_page_fits():
    small, asked_small = heap.huge_page_buffer(4096)
    big, asked_big = heap.huge_page_buffer(3 * heap.HUGE_PAGE + 5)
    assert small.numel() == 4096 and big.numel() == 3 * heap.HUGE_PAGE + 5
    assert big.data_ptr() % heap.HUGE_PAGE == 0 and small.data_ptr() % heap.HUGE_PAGE == 0
    assert not asked_small
    assert asked_big == (sys.platform.startswith("linux") and heap._libc() is not None)


def test_a_buffer_is_forgotten_when_its_last_tensor_goes():
    """A freed buffer's address range is reused by the allocator; were it still listed, a fresh
    tensor there would be taken as gathered and never moved (CI found one: a test's int8 codes
    landed in an earlier test's freed buffer)."""
    import gc
    before = set(heap._gathered)       # other tests' buffers may go meanwhile: only ours counts
    a, b = heap.gather([torch.randn(1000), torch.randn(300)])
    p = torch.nn.Parameter(b.view(30, 10), requires_grad=False)   # what load_model makes
    del a, b
    gc.collect()
    ours = set(heap._gathered) - before
    assert heap.gathered(p) and len(ours) == 1, "a view keeps it"
    del p
    gc.collect()
    assert not ours & set(heap._gathered)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_gather_packed_moves_what_is_not_gathered_and_keeps_the_products(quantization):
    """A quantized kernel's codes and scales move, a plain weight the model made moves with its
    Linear's ``weight`` (one copy, not two), a weight already gathered (the HF module's, which
    load_model gathers) stays."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, generator=g)
    made = Linear(torch.randn(24, 40, generator=g), None, TorchLinear())
    held = Linear(heap.gather([torch.randn(16, 40, generator=g)])[0], None, TorchLinear())
    kernel = get_quantized_kernel(quantization, torch.device("cpu"))
    quant = Linear(torch.randn(32, 40, generator=g), torch.randn(32, generator=g), kernel)
    want = [lin(x) for lin in (made, held, quant)]
    held_before, made_before = held.packed, made.packed
    assert not heap.gathered(made_before) and heap.gathered(held_before)
    moved = gather_packed([made, held, quant])
    assert held.packed is held_before, "a gathered weight is not copied again"
    assert made.packed is not made_before and made.weight is made.packed
    parts = [t for t in (quant.packed if isinstance(quant.packed, tuple) else (quant.packed,))
             if t.is_contiguous()]
    assert parts and all(heap.gathered(t) for t in parts + [made.packed])
    assert moved == sum(t.numel() * t.element_size() for t in parts + [made.packed])
    assert len({t.untyped_storage().data_ptr() for t in parts + [made.packed]}) == 1
    assert all(torch.equal(lin(x), w) for lin, w in zip((made, held, quant), want))


def test_load_model_puts_the_parameters_on_huge_pages_tied_ones_once():
    """A fresh load (the session's ``tiny`` may have been handed to worker ranks since, which moves
    its storage into shared memory)."""
    from minillm.models import load_model
    model = load_model("tiny-llama", dtype=torch.float32).hf_model
    params = list(model.parameters())
    assert all(heap.gathered(p) for p in params)
    assert len({p.untyped_storage().data_ptr() for p in params}) == 1
    if model.config.tie_word_embeddings:
        assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
