"""Tests of tknp_megatron.analysis.plots: PNGs from synthetic rows, CSV/JSON round trips."""

import json
import math
import struct
import subprocess
import sys

import pytest

from tknp_megatron.analysis.plots import (
    ModeResult,
    load_rows,
    main,
    plot_latency_panels,
    plot_slo_vs_rate,
    plot_throughput_vs_batch,
    rows_to_csv,
    rows_to_json,
)

MODES = ("TKNP", "DP", "TP", "PP", "DCP")
CONTEXTS = (32_768, 65_536, 98_304)
BATCHES = (4, 8, 16, 32, 64, 96, 128)
RATES = (0.5, 1.0, 2.0)
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows():
    """Synthetic curves: DP leads small batches, TKNP large ones; plus Poisson rows."""
    rows = []
    for m, mode in enumerate(MODES):
        for ctx in CONTEXTS:
            for b in BATCHES:
                cap = 16 * (2 if mode == "DP" else 5) * 32_768 / ctx
                waves = math.ceil(b / cap)
                rows.append(ModeResult(
                    mode=mode, context=ctx, offered_batch=b,
                    completion_throughput_tok_s=100.0 * min(b, cap) / (1 + 0.1 * m),
                    queue_wait_s_mean=20.0 * (waves - 1),
                    itl_s_p95=0.03 + 0.001 * min(b, cap) + 0.005 * m,
                    completion_time_s_mean=40.0 * waves,
                    slo_attainment=1.0 / waves))
        for rate in RATES:
            rows.append(ModeResult(mode, 0, 64, 500.0 / (1 + m), 1.0, 0.05, 60.0,
                                   min(1.0, 1.2 / rate / (1 + 0.2 * m)), arrival_rate=rate))
    return rows


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == _PNG_MAGIC
    assert data[12:16] == b"IHDR"
    assert len(data) > 10_000  # lines, markers and labels, not an empty canvas
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def mpl():
    return pytest.importorskip("matplotlib")


def test_throughput_vs_batch_png(mpl, tmp_path):
    out = plot_throughput_vs_batch(_rows(), tmp_path / "fig8.png")
    width, height = _png_size(out)
    assert width > 2 * height  # three panels side by side


def test_throughput_subset_of_contexts(mpl, tmp_path):
    w1, _ = _png_size(plot_throughput_vs_batch(_rows(), tmp_path / "a.png", contexts=[65_536]))
    w3, _ = _png_size(plot_throughput_vs_batch(_rows(), tmp_path / "b.png"))
    assert w3 > 2 * w1


def test_latency_panels_png(mpl, tmp_path):
    out = plot_latency_panels(_rows(), 65_536, tmp_path / "sub" / "fig9.png")
    _png_size(out)


def test_slo_vs_rate_png(mpl, tmp_path):
    _png_size(plot_slo_vs_rate(_rows(), tmp_path / "fig12a.png"))


def test_unknown_mode_gets_a_style(mpl, tmp_path):
    rows = _rows() + [ModeResult("TKNP-MB", 32_768, b, 1.0, 0.0, 0.05, 1.0, 1.0)
                      for b in BATCHES]
    _png_size(plot_throughput_vs_batch(rows, tmp_path / "mb.png"))


def test_missing_rows_raise(mpl, tmp_path):
    batch_only = [r for r in _rows() if r.arrival_rate is None]
    with pytest.raises(ValueError):
        plot_slo_vs_rate(batch_only, tmp_path / "x.png")
    with pytest.raises(ValueError):
        plot_latency_panels(_rows(), 1234, tmp_path / "x.png")


def test_main_writes_every_figure(mpl, tmp_path, capsys):
    src = rows_to_json(_rows(), tmp_path / "rows.json")
    written = main([str(src), "--out", str(tmp_path / "figs")])
    assert set(written) == {"throughput", "slo"} | {f"latency_{c}" for c in CONTEXTS}
    for path in written.values():
        _png_size(path)


def test_csv_round_trip(tmp_path):
    rows = _rows()
    rows[0] = ModeResult("TKNP", 4096, 1, 1.0 / 3.0, math.nan, 0.1, 2.0, 0.5)
    back = load_rows(rows_to_csv(rows, tmp_path / "rows.csv"))
    assert back[1:] == rows[1:]
    assert math.isnan(back[0].queue_wait_s_mean) and back[0].arrival_rate is None
    assert back[0].completion_throughput_tok_s == 1.0 / 3.0  # repr keeps every digit


def test_json_round_trip_and_plain_list(tmp_path):
    rows = _rows()
    assert load_rows(rows_to_json(rows, tmp_path / "rows.json")) == rows
    extra = [dict(r.as_dict(), waves=3) for r in rows[:3]]  # extra keys are ignored
    for d in extra:
        del d["arrival_rate"]
    (tmp_path / "list.json").write_text(json.dumps(extra))
    assert load_rows(tmp_path / "list.json") == rows[:3]
    with pytest.raises(ValueError):
        ModeResult.from_dict({"mode": "DP"})


def test_module_imports_without_matplotlib():
    code = ("import sys, tknp_megatron.analysis.plots, tknp_megatron.analysis.workload; "
            "assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
