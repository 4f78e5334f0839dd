"""The fused MoE's tile-config table: the lookup by shape, dtype, device and token bucket,
the default by size where the table has no entry, and what the tuning script writes (its
timing needs a GPU; the table it writes from timings is checked here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill_platform_cuda.fused_moe_configs import (
    TABLE_PATH,
    TileConfig,
    candidate_configs,
    choose_config,
    default_config,
    fastest,
    read_table,
    table_key,
    with_entry,
    write_table,
)

KEY = table_key(8, 4096, 14336, "bfloat16", "NVIDIA H200")
SMALL, LARGE = TileConfig(16, 64, 128, 4, 4), TileConfig(64, 128, 64, 8, 3)


def test_the_key_names_every_field_and_the_device_without_spaces():
    assert KEY == "E=8,H=4096,I=14336,dtype=bfloat16,device=NVIDIA_H200"


def test_a_step_takes_the_smallest_bucket_at_or_above_its_tokens(tmp_path):
    path = tmp_path / "table.json"
    write_table(with_entry(with_entry({}, KEY, 256, LARGE), KEY, 16, SMALL), path)
    table = read_table(path)
    assert list(table[KEY]) == ["16", "256"]  # written in bucket order
    assert choose_config(table, KEY, 1, 2, 8) == SMALL
    assert choose_config(table, KEY, 16, 2, 8) == SMALL
    assert choose_config(table, KEY, 17, 2, 8) == LARGE
    assert choose_config(table, KEY, 100_000, 2, 8) == LARGE  # past the largest bucket: the largest


def test_a_shape_not_in_the_table_gets_the_default_by_size():
    table = with_entry({}, KEY, 16, SMALL)
    other = table_key(8, 4096, 14336, "float8_e4m3fn", "NVIDIA H200")
    assert choose_config(table, other, 4, 2, 8) == default_config(4, 2, 8)
    assert default_config(4, 2, 8).block_m == 16  # one row per expert: the smallest row block
    assert default_config(4096, 2, 8).block_m == 64  # a thousand rows per expert: a large one


def test_retuning_a_bucket_replaces_it_and_keeps_the_others():
    table = with_entry(with_entry({}, KEY, 16, SMALL), KEY, 256, SMALL)
    retuned = with_entry(table, KEY, 256, LARGE)
    assert retuned[KEY] == {"16": SMALL.as_json(), "256": LARGE.as_json()}
    assert table[KEY]["256"] == SMALL.as_json()  # the input is not changed


def test_the_fastest_candidate_is_recorded_and_an_empty_run_is_refused():
    assert fastest({SMALL: 2.0, LARGE: 1.5}) == LARGE
    with pytest.raises(ValueError, match="every candidate failed"):
        fastest({})
    candidates = candidate_configs()
    assert len(set(candidates)) == len(candidates) and SMALL in candidates


def test_the_packaged_table_reads_and_every_entry_is_a_config():
    for buckets in read_table(TABLE_PATH).values():
        for size, fields in buckets.items():
            assert int(size) > 0 and TileConfig.from_json(fields) == TileConfig(**fields)
    assert isinstance(json.loads(TABLE_PATH.read_text()), dict)


def test_the_tuning_script_refuses_to_run_without_a_gpu():
    script = Path(__file__).parents[3] / "scripts" / "tune-fused-moe.py"
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would tune")
    child = subprocess.run([sys.executable, str(script), "--experts", "8", "--hidden", "64", "--intermediate", "32"],
                           capture_output=True, text=True)
    assert child.returncode != 0 and "needs a CUDA GPU" in child.stderr
