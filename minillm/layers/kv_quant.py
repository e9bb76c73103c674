"""Rung 9 — a narrower KV slot: the cache stored in 16 bits, int8 or fp8 (notebook 09).

Every rung so far fought over where KV slots go; this one shrinks the slot. On SmolLM2 one token's
K and V over all layers are 30 × 2 × 3 heads × 64 numbers: 46,080 bytes in fp32, 23,040 in 16
bits, and 12,240 in int8 or fp8 with one fp32 scale per token and KV head (64 bytes of numbers +
4 of scale per head row) -- 3.76x the tokens of fp32 in the same bytes.

``kv_cache_dtype`` names a ``KVCacheFormat``:

* ``"auto"``: the model's dtype (no conversion; the pool is a plain tensor);
* ``"float16"`` / ``"bfloat16"``: a cast on write, a cast back on read;
* ``"int8"``: symmetric, ``scale = max|x| / 127`` per token and KV head, computed when the row is
  written (LMDeploy's online KV quantization); read as ``q * scale``;
* ``"fp8"``: float8 e4m3 (max 448) with the same per-token, per-head scale (finer than vLLM's
  per-tensor scale, and one code path with int8).

A narrow pool is a ``QuantizedPool``: it answers the few tensor operations the torch reference
attention uses on a pool (``view``, ``index_copy_`` to write rows, ``index_select`` and indexing
by block to read them), quantizing on the write and dequantizing only the rows read. So the
reference attention of rung 3 runs unchanged on it; the C++ and Triton kernels take ``data`` and
``scale`` and dequantize inside their loops (lab exercise 09: ``quantize`` and ``dequantize``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "int8", "fp8")


@dataclass(frozen=True)
class KVCacheFormat:
    """How one K or V row is stored: its element type and whether a scale goes with it."""

    name: str
    storage: torch.dtype | None     # None: the model's own dtype
    qmax: float | None = None       # the largest stored magnitude; None: no scale (a plain cast)

    @property
    def scaled(self) -> bool:
        return self.qmax is not None

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.storage or model_dtype

    def row_bytes(self, head_dim: int, model_dtype: torch.dtype) -> int:
        """Bytes of one token's K (or V) row for one KV head, its scale included."""
        elem = torch.empty((), dtype=self.storage_dtype(model_dtype)).element_size()
        return head_dim * elem + (4 if self.scaled else 0)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int,
                        model_dtype: torch.dtype) -> int:
        """One token's K and V over all layers: the unit the block manager's capacity is in."""
        return 2 * num_layers * num_kv_heads * self.row_bytes(head_dim, model_dtype)


FORMATS = {
    "auto": KVCacheFormat("auto", None),
    "float16": KVCacheFormat("float16", torch.float16),
    "bfloat16": KVCacheFormat("bfloat16", torch.bfloat16),
    "int8": KVCacheFormat("int8", torch.int8, 127.0),
    "fp8": KVCacheFormat("fp8", torch.float8_e4m3fn, 448.0),
}


def get_format(name: str) -> KVCacheFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def quantize(x: torch.Tensor, fmt: KVCacheFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``x`` [..., head_dim] -> (stored values [..., head_dim], scales [...] in fp32 or None).

    The scale is computed in fp32 whatever the model's dtype: ``max|x| / qmax`` per row, so the
    row's largest element lands on ±qmax and nothing is clipped. An all-zero row gets scale 1."""
    if not fmt.scaled:
        return x.to(fmt.storage), None
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # (a row so tiny that amax / qmax underflows gets the smallest normal scale: it reads as 0)
    # Divided by a tensor, not the number: CUDA divides a tensor by a scalar as a multiply by
    # its reciprocal, one ulp off IEEE in half the rows, and then codes one step off the Triton
    # store's ``div_rn`` (seen on an H200, bf16 K/V into fp8: python -m minillm.gpu_check)
    qmax = torch.full_like(amax, fmt.qmax)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).clamp_(
        min=torch.finfo(torch.float32).tiny)
    y = xf / scale[..., None]
    if fmt.storage == torch.int8:
        y = y.round_().clamp_(-fmt.qmax, fmt.qmax)
    return y.to(fmt.storage), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., head_dim] (and their scales [...]) -> rows in ``dtype``."""
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale[..., None]).to(dtype)


class QuantizedPool:
    """One layer's K (or V) pool in a narrower format: ``data`` [blocks, block_size, kv_heads,
    head_dim] in the format's storage type and ``scale`` [blocks, block_size, kv_heads] (fp32, or
    None for a plain 16-bit cast). Reads return rows in ``dtype``, the model's."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None, fmt: KVCacheFormat,
                 dtype: torch.dtype):
        self.data, self.scale, self.fmt, self.dtype = data, scale, fmt, dtype

    @classmethod
    def zeros(cls, shape: tuple[int, ...], fmt: KVCacheFormat, dtype: torch.dtype,
              device: torch.device) -> QuantizedPool:
        data = torch.zeros(shape, dtype=fmt.storage, device=device)
        scale = torch.ones(shape[:-1], dtype=torch.float32, device=device) if fmt.scaled else None
        return cls(data, scale, fmt, dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> list[torch.Tensor]:
        """What the pool really holds (for its byte count and for block copies)."""
        return [self.data] + ([self.scale] if self.scale is not None else [])

    def view(self, *shape: int) -> QuantizedPool:
        """The same memory seen with other leading dimensions (the last one stays head_dim)."""
        scale = self.scale.view(*shape[:-1]) if self.scale is not None else None
        return QuantizedPool(self.data.view(*shape), scale, self.fmt, self.dtype)

    def stored(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as this pool returns them once written (quantized, then read back): what a
        prompt's own K/V are to its prefill, without a trip through the blocks."""
        return dequantize(*quantize(rows, self.fmt), self.dtype)

    def index_copy_(self, dim: int, index: torch.Tensor, rows: torch.Tensor) -> QuantizedPool:
        """Write ``rows`` at ``index`` along the first dimension: quantize on write."""
        if dim != 0:
            raise ValueError("a QuantizedPool is written along its first dimension only")
        q, scale = quantize(rows, self.fmt)
        # torch's CPU index_copy_ has no float8 kernel: the same bytes, copied as uint8
        raw = torch.uint8 if q.dtype.itemsize == 1 and q.is_floating_point() else q.dtype
        self.data.view(raw).index_copy_(0, index, q.view(raw))
        if scale is not None:
            self.scale.index_copy_(0, index, scale)
        return self

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows at ``index``, dequantized: only the rows read are ever widened."""
        if dim != 0:
            raise ValueError("a QuantizedPool is read along its first dimension only")
        scale = self.scale.index_select(0, index) if self.scale is not None else None
        return dequantize(self.data.index_select(0, index), scale, self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        """``pool[block_ids]``: those blocks, dequantized."""
        scale = self.scale[index] if self.scale is not None else None
        return dequantize(self.data[index], scale, self.dtype)


def make_pool(shape: tuple[int, ...], fmt: KVCacheFormat, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor | QuantizedPool:
    """A zeroed K or V pool: a plain tensor for ``auto``, a ``QuantizedPool`` otherwise."""
    if fmt.storage is None or fmt.storage == dtype:
        return torch.zeros(shape, dtype=dtype, device=device)
    return QuantizedPool.zeros(shape, fmt, dtype, device)


def pool_tensors(pool: torch.Tensor | QuantizedPool) -> list[torch.Tensor]:
    return pool.tensors() if isinstance(pool, QuantizedPool) else [pool]
