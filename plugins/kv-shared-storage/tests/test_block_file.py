"""A block file round trip, and every way a file is refused rather than used."""

from __future__ import annotations

import pytest
import torch
from tokenmill_kv_shared_storage.block_file import BadBlockFile, read_block, scatter_block, write_block


def _caches(num_layers: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (5, 4, 2, 8)  # blocks, block size, KV heads, head size
    return [(torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype))
            for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_comes_back_bit_for_bit_into_another_block(tmp_path, dtype):
    source, target = _caches(dtype=dtype), _caches(dtype=dtype, seed=1)
    path = tmp_path / "b.kvb"
    write_block(path, source, block_id=3)
    scatter_block(read_block(path, target), target, block_id=1)
    for (sk, sv), (tk, tv) in zip(source, target, strict=True):
        assert torch.equal(tk[1], sk[3]) and torch.equal(tv[1], sv[3])
    assert not torch.equal(target[0][0][0], source[0][0][3])  # the other blocks are untouched
    assert [p.name for p in tmp_path.iterdir()] == ["b.kvb"]  # no temporary file left


def test_a_damaged_or_foreign_file_is_refused(tmp_path):
    caches = _caches()
    path = tmp_path / "b.kvb"
    write_block(path, caches, block_id=0)
    good = path.read_bytes()
    cases = {
        "checksum mismatch": good[:-1] + bytes([good[-1] ^ 0x80]),
        "truncated": good[:-3],
        "not a KV block file": b"junk",
    }
    for reason, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(BadBlockFile, match=reason):
            read_block(path, caches)
    path.write_bytes(good)
    with pytest.raises(BadBlockFile, match="another KV layout"):
        read_block(path, _caches(num_layers=2))
    with pytest.raises(BadBlockFile, match="another KV layout"):
        read_block(path, _caches(dtype=torch.bfloat16))
    with pytest.raises(BadBlockFile, match="cannot be read"):
        read_block(tmp_path / "missing.kvb", caches)
