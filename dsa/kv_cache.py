"""FP8 KV-cache formats: their byte layouts, quantisation and dequantisation, stated once.

A cache holds pages of ``page_size`` tokens, one MLA latent row a token (one
kv head). Two FP8 layouts are served, FlashMLA's (docs/semantics.md, "FP8 KV
caches"):

* ``fp8_v32`` (DeepSeek V3.2), 656 bytes a token, every token on its own:
  ``[0, 512)`` 512 e4m3 NoPE values, ``[512, 528)`` 4 fp32 scales (one per
  128 NoPE values), ``[528, 656)`` 64 bf16 RoPE values. Dequantised row: 576.
* ``fp8_model1`` (DeepSeek V4 / MODEL1), 584 bytes a token, laid out per page:
  first ``page_size`` token records of 576 bytes (``[0, 448)`` 448 e4m3 NoPE
  values, ``[448, 576)`` 64 bf16 RoPE values), then ``page_size`` scale
  records of 8 bytes (7 e8m0 scales, one per 64 NoPE values, and one unused
  byte). Dequantised row: 512.

Dequantisation (exact in fp32): NoPE value ``i`` of a token is
``e4m3(byte) * scale[i // tile]``; e4m3 is OCP's E4M3FN (0x7F / 0xFF are NaN),
an e8m0 scale byte ``b`` is ``2**(b - 127)`` (255 is NaN); RoPE values are the
stored bf16. Quantisation of a row ``x``: per tile, ``scale = 2 **
ceil(log2(max(amax(|x_tile|) / 448, 1e-4)))`` (computed in fp32), NoPE bytes
``e4m3(clamp(x / scale, -448, 448))`` rounded to nearest even, RoPE stored as
bf16. FlashMLA's quantiser writes the same bytes.

A cache tensor is ``[num_pages, page_size, bytes]`` (or with a 1-wide head axis
before ``bytes``) of uint8, int8 or float8_e4m3fn; the bytes of a page are
contiguous, pages may be padded (any page stride, in bytes a multiple of 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4  # the smallest amax / 448 a scale is derived from


@dataclass(frozen=True)
class CacheFormat:
    """One FP8 layout (see the module header).

    D: dequantised row width (d_nope + d_rope); tile: NoPE values per scale;
    token_bytes: bytes of a token's data record (NoPE then, at rope_offset,
    RoPE); scale_base / scale_stride: where a token's scales start, from its
    page's first byte, is ``scale_base + offset * scale_stride`` when
    ``per_page`` and ``offset * token_bytes + scale_base`` otherwise;
    scale_bytes: 4 (fp32) or 1 (e8m0)."""

    name: str
    d_nope: int
    d_rope: int
    tile: int
    token_bytes: int
    rope_offset: int
    scale_bytes: int
    per_page: bool  # scales in a region after the page's token records
    scale_record: int  # bytes of one token's scale record

    @property
    def D(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def n_tiles(self) -> int:
        return self.d_nope // self.tile

    @property
    def bytes_per_token(self) -> int:
        return self.token_bytes + (self.scale_record if self.per_page else 0)

    def scale_base(self, page_size: int) -> int:
        """Byte offset of token 0's scales: from its record (inline) or from its page (per page)."""
        return page_size * self.token_bytes if self.per_page else self.d_nope

    def scale_stride(self) -> int:
        """Bytes between the scale records of consecutive tokens of a page."""
        return self.scale_record if self.per_page else self.token_bytes


FORMATS: Dict[str, CacheFormat] = {
    "fp8_v32": CacheFormat("fp8_v32", d_nope=512, d_rope=64, tile=128, token_bytes=656, rope_offset=528,
                           scale_bytes=4, per_page=False, scale_record=16),
    "fp8_model1": CacheFormat("fp8_model1", d_nope=448, d_rope=64, tile=64, token_bytes=576, rope_offset=448,
                              scale_bytes=1, per_page=True, scale_record=8),
}
NATIVE = "native"  # the cache holds q's dtype, not quantised
CACHE_FORMATS = (NATIVE,) + tuple(FORMATS)
BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def format_named(name: str) -> CacheFormat:
    if name not in FORMATS:
        raise ValueError(f"cache_format: expected one of {tuple(FORMATS)}, got {name!r}")
    return FORMATS[name]


def format_of_bytes(bytes_per_token: int) -> Optional[str]:
    """The FP8 format whose tokens take this many bytes (None if none does)."""
    for name, f in FORMATS.items():
        if f.bytes_per_token == bytes_per_token:
            return name
    return None


def _pages(cache: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    """[P, page_size * bytes_per_token] uint8 view of a cache (page stride kept)."""
    c = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    c = c.reshape(c.shape[0], c.shape[1], -1) if c.dim() == 4 else c
    P, PS, B = c.shape
    if B != fmt.bytes_per_token or c.stride(2) != 1 or c.stride(1) != B:
        raise ValueError(f"kv_cache: expected pages of {PS} contiguous tokens of {fmt.bytes_per_token} bytes "
                         f"({fmt.name}), got shape {tuple(c.shape)} strides {c.stride()}")
    return c.as_strided((P, PS * B), (c.stride(0), 1))


def _byte_fields(pages: torch.Tensor, fmt: CacheFormat, page: torch.Tensor, offset: torch.Tensor,
                 page_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NoPE bytes [M, d_nope], scale bytes [M, n_tiles * scale_bytes], RoPE bytes [M, 2 * d_rope]) of the
    tokens (page[m], offset[m])."""
    rec = offset.view(-1, 1) * fmt.token_bytes
    nope = pages[page.view(-1, 1), rec + torch.arange(fmt.d_nope, device=pages.device)]
    rope = pages[page.view(-1, 1), rec + fmt.rope_offset + torch.arange(2 * fmt.d_rope, device=pages.device)]
    sc0 = fmt.scale_base(page_size) + (offset.view(-1, 1) * fmt.scale_stride() if fmt.per_page else rec)
    scales = pages[page.view(-1, 1), sc0 + torch.arange(fmt.n_tiles * fmt.scale_bytes, device=pages.device)]
    return nope, scales, rope


def _scale_values(scale_bytes: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    """[M, n_tiles] fp32 scales from their bytes."""
    if fmt.scale_bytes == 4:
        return scale_bytes.contiguous().view(torch.float32)
    return scale_bytes.contiguous().view(torch.float8_e8m0fnu).float()


def dequantize_rows(cache: torch.Tensor, cache_format: str, page: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The dequantised rows of the tokens (page[m], offset[m]): [M, D] fp32.

    page / offset: int64 [M], in range (the caller masks invalid slots)."""
    fmt = FORMATS[cache_format]
    page_size = cache.shape[1]
    pages = _pages(cache, fmt)
    nope, sc, rope = _byte_fields(pages, fmt, page.reshape(-1), offset.reshape(-1), page_size)
    scales = _scale_values(sc, fmt)
    values = nope.contiguous().view(torch.float8_e4m3fn).float().view(-1, fmt.n_tiles, fmt.tile)
    values = (values * scales.unsqueeze(-1)).view(-1, fmt.d_nope)
    return torch.cat([values, rope.contiguous().view(torch.bfloat16).float()], dim=-1)


def dequantize_kv_cache(cache: torch.Tensor, cache_format: str) -> torch.Tensor:
    """An FP8 cache [P, page_size, bytes] (or [P, page_size, 1, bytes]) -> [P, page_size, D] fp32, exactly."""
    fmt = cache_format_of(cache, cache_format)
    P, PS = cache.shape[0], cache.shape[1]
    dev = cache.device
    page = torch.arange(P, device=dev).repeat_interleave(PS)
    offset = torch.arange(PS, device=dev).repeat(P)
    return dequantize_rows(cache, fmt.name, page, offset).view(P, PS, fmt.D)


def cache_format_of(cache, name: str) -> CacheFormat:
    """The format ``name`` after checking that ``cache`` is a byte tensor of its pages."""
    from dsa._checks import dense_tensor  # (dsa._checks imports this module)

    fmt = format_named(name)
    dense_tensor("kv_cache", cache)
    if cache.dtype not in BYTE_DTYPES:
        raise ValueError(f"kv_cache: expected a byte dtype (uint8, int8, float8_e4m3fn) for {name}, got {cache.dtype}")
    if not (cache.dim() == 3 or (cache.dim() == 4 and cache.shape[2] == 1)) or cache.shape[-1] != fmt.bytes_per_token:
        raise ValueError(f"kv_cache: expected [num_pages, page_size, {fmt.bytes_per_token}] (or with a 1-wide head axis) "
                         f"for {name}, got {tuple(cache.shape)}")
    return fmt


def quantize_kv_cache(kv: torch.Tensor, cache_format: str) -> torch.Tensor:
    """Quantise pages of latent rows into an FP8 cache.

    kv: [num_pages, page_size, D] or [num_pages, page_size, 1, D], any float
    dtype, D = 576 for ``fp8_v32`` and 512 for ``fp8_model1``. Returns uint8
    [num_pages, page_size, bytes_per_token] (656 / 584 bytes), contiguous;
    ``dequantize_kv_cache`` of it is the exact value the kernels compute with.
    """
    from dsa._checks import dense_tensor  # (dsa._checks imports this module)

    fmt = format_named(cache_format)
    if not dense_tensor("kv", kv).is_floating_point():
        raise TypeError(f"kv: expected a floating-point torch.Tensor, got {kv.dtype}")
    if kv.dim() == 4 and kv.shape[2] == 1:
        kv = kv[:, :, 0]
    if kv.dim() != 3 or kv.shape[-1] != fmt.D:
        raise ValueError(f"kv: expected [num_pages, page_size, {fmt.D}] for {fmt.name}, got {tuple(kv.shape)}")
    P, PS, _ = kv.shape
    x = kv.float()
    tiles = x[..., : fmt.d_nope].reshape(P, PS, fmt.n_tiles, fmt.tile)
    amax = tiles.abs().amax(-1)
    scale = torch.pow(2.0, torch.ceil(torch.log2(torch.clamp_min(amax / E4M3_MAX, SCALE_FLOOR))))
    nope = torch.clamp(tiles / scale.unsqueeze(-1), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    nope = nope.view(torch.uint8).reshape(P, PS, fmt.d_nope)
    rope = x[..., fmt.d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    if fmt.scale_bytes == 4:
        sc = scale.contiguous().view(torch.uint8)
    else:
        sc = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    sc = torch.cat([sc, sc.new_zeros(P, PS, fmt.scale_record - sc.shape[-1])], dim=-1)
    if fmt.per_page:  # token records, then the page's scale records
        rec = torch.cat([nope, rope], dim=-1)  # [P, PS, 576]
        flat = torch.cat([rec.reshape(P, -1), sc.reshape(P, -1)], dim=-1)
    else:
        rec = torch.empty(P, PS, fmt.token_bytes, dtype=torch.uint8, device=kv.device)
        rec[..., : fmt.d_nope] = nope
        rec[..., fmt.d_nope: fmt.d_nope + fmt.scale_record] = sc
        rec[..., fmt.rope_offset:] = rope
        flat = rec.reshape(P, -1)
    return flat.reshape(P, PS, fmt.bytes_per_token).contiguous()
