"""bench/sweep.py: the shape grammar, the state it builds, and the fixed/marginal fit."""

from __future__ import annotations

import pytest
import torch

from bench import sweep as bench_sweep


def test_shape_grammar():
    assert bench_sweep.parse_shape("h1024-tp2-opt80") == {"h": 1024, "tp": 2, "opt": 80}
    with pytest.raises(ValueError):
        bench_sweep.parse_shape("h1024-tp2-opt50")


@pytest.mark.parametrize("opt", [0, 80])
def test_sweep_state_has_the_requested_size_and_opt_share(opt):
    layers = bench_sweep.layers_for(8, 256, 2, opt)
    sd = bench_sweep.sweep_state(0, 2, 256, layers, 2, opt)
    total = sum(sh.data.numel() * sh.data.element_size() for sh in sd.values())
    assert abs(total / 2**20 - 8) < 1.5
    flat = sum(
        sh.data.numel() * sh.data.element_size() for sh in sd.values() if sh.flattened_range is not None
    )
    assert round(100 * flat / total) == opt


def test_fit_recovers_fixed_and_marginal_cost():
    rows = [
        {
            "shape": "s",
            "size_mib": m,
            "layers": 1,
            "gib_per_rank": m / 1024,
            "seconds": {
                "raw write": 1.0 * m / 1024,
                "raw read": 0.5 * m / 1024,
                "save": 0.02 + 1.2 * m / 1024,
                "load": 0.01 + 0.5 * m / 1024,
                "load resharded": 0.03 + 0.6 * m / 1024,
            },
        }
        for m in (64, 256, 1024)
    ]
    text = bench_sweep.fit(rows)
    assert "| s | save | 0.020 | 1.200 | 1.20 |" in text
    assert "| s | load resharded | 0.030 | 0.600 | 1.20 |" in text


def test_table_marks_each_goal_missed():
    row = {
        "shape": "s",
        "size_mib": 256,
        "layers": 4,
        "gib_per_rank": 0.25,
        "seconds": {"raw write": 1.0, "raw read": 0.9, "save": 1.25, "load": 1.0, "load resharded": 1.3},
    }
    q = bench_sweep.ratios(row)
    assert (round(q["save"], 2), round(q["load"], 2), round(q["resharded"], 2)) == (0.8, 0.9, 1.3)
    line = bench_sweep.table([row]).splitlines()[-1]
    assert line.endswith("| 0.80 ✗ | 0.90 | 1.30 ✗ |")


def test_layer_size_matches_layers_for():
    shape = bench_sweep.parse_shape("h1024-tp2-opt80")
    assert bench_sweep.layers_for(4 * bench_sweep.layer_mib(shape), 1024, 2, 80) == 4


def test_read_files_fills_the_destinations_with_the_files_bytes_in_order(tmp_path):
    from bench.files import read_files

    data = [bytes(range(256)) * 40, b"\x07" * 5000, bytes(reversed(range(256))) * 9]
    paths = []
    for i, d in enumerate(data):
        paths.append(tmp_path / f"f{i}")
        paths[-1].write_bytes(d)
    joined = b"".join(data)
    # Destinations that split the files anywhere, and fewer bytes than the files hold: the
    # rest is read into scratch, and every byte is counted.
    dests = [torch.zeros(n, dtype=torch.uint8) for n in (3, 10000, 0, 2500)]
    assert read_files(paths, dests) == len(joined)
    got = b"".join(bytes(t.numpy()) for t in dests)
    assert got == joined[: len(got)] and len(got) == 12503
    # More destination bytes than the files: the files' bytes first, the rest untouched.
    wide = [torch.full((len(joined) + 10,), 9, dtype=torch.uint8)]
    read_files(paths, wide)
    assert bytes(wide[0].numpy()[: len(joined)]) == joined and (wide[0][len(joined) :] == 9).all()


@pytest.mark.parametrize("checksum", [False, True])
def test_write_files_deals_the_tensors_to_the_files_as_a_save_does(tmp_path, checksum):
    from bench.files import write_files

    tensors = [torch.arange(n, dtype=torch.int32) * (i + 1) for i, n in enumerate((700, 0, 3000, 50, 1200))]
    raw = [bytes(t.numpy()) for t in tensors]
    paths = [tmp_path / f"w{i}" for i in range(3)]
    assert write_files(paths, tensors, checksum, block=1000) == sum(map(len, raw))
    # largest first, each to the file with the fewest bytes: 3000 | 1200 | 700, then 50 to the third
    assert [p.read_bytes() for p in paths] == [raw[2], raw[4], raw[0] + raw[3]]
    assert write_files([tmp_path / "none"], [], checksum) == 0 and (tmp_path / "none").read_bytes() == b""


def test_fixed_cost_phase_table_has_each_ranks_median_and_their_sum():
    from bench.fixed_cost import phase_table

    by_rank = [
        {"save": {"writing": 0.003, "commit": 0.001}, "load": {"reading": 0.002}},
        {"save": {"writing": 0.004}, "load": {"reading": 0.0025, "closing check": 0.0005}},
    ]
    lines = phase_table(by_rank).splitlines()
    assert lines[0] == "| op | phase | rank 0 / rank 1 ms |"
    assert "| save | writing | 3.00 / 4.00 |" in lines
    assert "| save | commit | 1.00 / 0.00 |" in lines  # a phase one rank did not run
    assert "| save | sum | 4.00 / 4.00 |" in lines
    assert "| load | closing check | 0.00 / 0.50 |" in lines
    assert "| load | sum | 2.00 / 3.00 |" in lines
