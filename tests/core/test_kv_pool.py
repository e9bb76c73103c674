"""One KV pool, allocated in one place (``minillm.core.kv_pool.KVPool``), and one
``ModelRunner.__init__`` every runner goes through: rung 3's (which rung 6 verifies with), rung 6's draft, rung 7's
stages differ only in their layers, never in how their K/V memory is laid out."""
from __future__ import annotations

import pytest
import torch

from minillm import LLM
from minillm.layers.attention.reference import TorchAttention
from minillm.core.kv_pool import KVPool
from minillm.core.model import PagedLlama
from minillm.core.runner import ModelRunner
from minillm.engines.r7_pipeline.stage import StageConfig, StageRunner, split_layers


def test_pool_holds_what_the_engine_accounts_for(tiny):
    """The bytes the pool's tensors really take = slots x the model's kv_bytes_per_token, the
    unit every memory count of the engine is in."""
    engine = LLM(tiny, engine="paged", num_blocks=24, block_size=4).engine
    pool = engine.runner.pool
    assert (pool.num_blocks, pool.block_size) == (engine.block_manager.num_blocks, 4)
    assert pool.num_layers == tiny.config.num_hidden_layers
    assert pool.num_bytes == 24 * 4 * tiny.kv_bytes_per_token
    assert engine.runner.kv_caches is pool.caches


def test_copy_blocks_copies_every_layer_k_and_v():
    pool = KVPool(3, num_blocks=6, block_size=2, num_kv_heads=1, head_dim=4,
                  dtype=torch.float32, device=torch.device("cpu"))
    for i, (k, v) in enumerate(pool.caches):
        k[1].fill_(10 + i)
        v[1].fill_(20 + i)
        k[4].fill_(30 + i)
    pool.copy_blocks([(1, 3), (4, 5)])
    pool.copy_blocks([])                     # nothing to copy: a no-op
    for i, (k, v) in enumerate(pool.caches):
        assert torch.equal(k[3], k[1]) and torch.equal(v[3], v[1])
        assert (k[3] == 10 + i).all() and (v[3] == 20 + i).all()
        assert (k[5] == 30 + i).all()
        assert (k[0] == 0).all() and (v[2] == 0).all()   # blocks not named are untouched


def test_speculative_runners_share_the_target_weights(tiny):
    engine = LLM(tiny, engine="paged+draft", draft_layers=1, num_blocks=20).engine
    target, draft = engine.runner, engine.proposer.runner
    assert type(target) is ModelRunner          # rung 6 verifies with the core's runner as is
    assert draft.net is target.net              # the same weight tensors: nothing copied
    assert draft.layers == range(1) and draft.pool.num_layers == 1
    assert target.pool.num_layers == tiny.config.num_hidden_layers
    assert draft.pool.num_blocks == 20 and draft.pool.dtype == target.pool.dtype


@pytest.mark.parametrize("world", [2, 3])
def test_stage_runners_hold_their_slice_only(tiny, world):
    net = PagedLlama(tiny.hf_model)
    config = StageConfig(world, num_blocks=8, block_size=4, attention_backend=None)
    slices = split_layers(len(net.layers), world)
    for rank in range(world):
        stage = StageRunner(net, rank, config, TorchAttention(), "cpu", torch.float32)
        assert (stage.start, stage.end) == slices[rank]
        assert stage.pool.num_layers == stage.end - stage.start
        assert stage.pool.num_blocks == 8 and stage.dtype == torch.float32


def test_runner_arguments_are_checked(tiny):
    net = PagedLlama(tiny.hf_model)
    with pytest.raises(ValueError, match="needs a model, or net=, device= and dtype="):
        ModelRunner(None, 4, 4, TorchAttention(), net=net)
    with pytest.raises(ValueError, match="contiguous slice of the model's 2 layers"):
        ModelRunner(tiny, 4, 4, TorchAttention(), layers=range(1, 3))


@pytest.mark.parametrize("fmt", ["auto", "bfloat16", "int8", "fp8"])
def test_blocks_move_between_pools_as_stored(fmt):
    """Rung 11's transfer: ``read_blocks`` of one pool written with ``write_blocks`` into other
    blocks of another pool of the same layout holds the same bytes (scales too) and reads back
    the same rows; a pool of another layout refuses them."""
    from minillm.layers.kv_quant import get_format

    def make(num_blocks):
        return KVPool(2, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=torch.float32, device=torch.device("cpu"), fmt=get_format(fmt))
    src, dst = make(6), make(9)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(24, 2, 8, generator=g)
    for k, v in src.caches:
        k.view(-1, 2, 8).index_copy_(0, torch.arange(24), rows)
        v.view(-1, 2, 8).index_copy_(0, torch.arange(24), rows * 2)
    data = src.read_blocks([4, 1])
    dst.write_blocks([0, 7], data)
    for a, b in zip(src.tensors(), dst.tensors()):
        assert torch.equal(a[[4, 1]].view(torch.uint8), b[[0, 7]].view(torch.uint8))
    for (k0, _), (k1, _) in zip(src.caches, dst.caches):
        assert torch.equal(k0[torch.tensor([4, 1])], k1[torch.tensor([0, 7])])
    other = KVPool(2, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8,
                   dtype=torch.float32, device=torch.device("cpu"), fmt=get_format(fmt))
    with pytest.raises(ValueError, match="layout"):
        other.write_blocks([0, 1], data)
    with pytest.raises(ValueError, match="layout"):
        dst.write_blocks([0], data)                    # two blocks of data, one block to fill


def test_allocate_loaded_gives_blocks_that_count_as_computed():
    from minillm.core.block_manager import BlockManager, NoFreeBlocksError
    from minillm.core.sequence import Sequence
    from minillm.request import Request

    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence(Request(list(range(1, 12))), list(range(1, 12)), 11)
    assert bm.allocate_loaded(seq, 10) == seq.block_table and len(seq.block_table) == 3
    assert seq.num_computed_tokens == 10 and seq.num_uncomputed == 1
    assert bm.num_free_blocks == 1
    other = Sequence(Request(list(range(1, 12))), list(range(1, 12)), 11)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_loaded(other, 10)
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.num_computed_tokens == 0
