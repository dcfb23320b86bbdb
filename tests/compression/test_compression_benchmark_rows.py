"""benchmarks/compression.py's wire-byte rows run, and say what each codec's format says.

The benchmark's model (784-2048-2048-1024-10) has two leaves over a million
elements; its wire rows once crashed on five codecs and nothing failed. Here
they are built as the benchmark builds them (8 replicas), and the ratio to a
float32 psum is checked against each codec's bits per element: every leaf but
the 10-element bias is compressed, so a block codec's ratio is ``32 / bits``
within 1%.
"""

import pytest

from adaptjax import compression as ajc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows(load_script):
    bench = load_script("benchmarks/compression.py")
    return bench, {r["codec"]: r for r in bench.wire_rows(8)}


def test_every_codec_has_a_row(rows):
    bench, by_name = rows
    assert set(by_name) == set(bench.CODECS) | {"onebit(2-level)"}
    for r in by_name.values():
        assert r["n"] == 8 and 0 < r["bytes"] < r["fp32_psum_bytes"]


def test_fixed_rate_codecs_send_their_bits_per_element(rows):
    bench, by_name = rows
    checked = 0
    for name, src in bench.CODECS.items():
        codec = eval(src, {"ajc": ajc})
        if not isinstance(codec, ajc.BlockCodec):  # sparse codecs route indices too
            continue
        bits = codec.bits
        assert by_name[name]["ratio_vs_fp32"] == pytest.approx(32 / bits, rel=0.01), name
        checked += 1
    assert checked >= 7  # bf16, fp16, onebit, terngrad, qsgd x2, natural


def test_randomk_sends_its_values_alone(rows):
    # shared random indices: 1% of the elements as float32 values, nothing else
    _, by_name = rows
    assert by_name["randomk(1%)"]["ratio_vs_fp32"] == pytest.approx(100, rel=0.01)
