"""The model config and the flat layout: llm.c's sizes, offsets and weight-decay segments."""
import numpy as np
import pytest

from llm.config import ConfigError, GPT2Config
from llm.layout import PARAM_NAMES, ParamViews, decay_segments, param_offsets, tensor_at


@pytest.mark.parametrize("desc, n", [("d6", 30357504), ("d12", 124475904), ("d24", 354871296),
                                     ("d36", 774090240), ("d48", 1557686400)])
def test_num_parameters_match_llmc(desc, n):
    assert GPT2Config.from_descriptor(desc).num_parameters == n


def test_tiny_descriptor_reads_layers_channels_heads():
    c = GPT2Config.from_descriptor("d2c64h4")
    assert ((c.num_layers, c.channels, c.num_heads, c.padded_vocab_size, c.max_seq_len)
            == (2, 64, 4, 50304, 1024))


@pytest.mark.parametrize("desc, message", [
    ("d7", "unsupported GPT-2 depth 7"),
    ("gpt2", r"unsupported model descriptor 'gpt2': use dL \(d6, d12, d24, d36, d48\) or dLcChNH "
             r"\(e.g. d2c64h4\)$"),   # no ", or a model file": --model and the benchmarks take no file
    ("d2c60h8", "channels 60 is not divisible by num_heads 8: choose a number of heads that divides the "
                "channels"),
])
def test_bad_descriptors_are_clear_errors(desc, message):
    with pytest.raises(ConfigError, match=message):
        GPT2Config.from_descriptor(desc)


def test_offsets_follow_llmc_order_for_124m():
    offsets = param_offsets(GPT2Config.from_descriptor("d12"))
    assert list(offsets) == list(PARAM_NAMES)
    assert offsets["wpe"] == (38633472, 786432)
    assert offsets["qkvw"] == (39438336, 21233664)
    assert offsets["fcprojb"] == (124465152, 9216)
    assert offsets["lnfb"] == (124475136, 768)


def test_views_share_the_flat_buffer():
    c = GPT2Config(max_seq_len=8, vocab_size=10, padded_vocab_size=16, num_layers=2, num_heads=2, channels=4)
    flat = np.zeros(c.num_parameters, np.float32)
    p = ParamViews(flat, c)
    p.qkvw[1, 2, 3] = 7.0
    assert flat[param_offsets(c)["qkvw"][0] + 1 * 12 * 4 + 2 * 4 + 3] == 7.0


def test_decay_segments_cut_a_shard_at_tensor_boundaries():
    c = GPT2Config(max_seq_len=8, vocab_size=10, padded_vocab_size=16, num_layers=2, num_heads=2, channels=4)
    off = param_offsets(c)
    lo, hi = off["wpe"][0] + 5, off["qkvw"][0] + 3       # the end of wpe, ln1w, ln1b, the start of qkvw
    assert decay_segments(c, lo, hi) == [(lo, off["ln1w"][0], True), (off["ln1w"][0], off["ln1b"][0], False),
                                         (off["ln1b"][0], off["qkvw"][0], False), (off["qkvw"][0], hi, True)]
    P = c.num_parameters
    assert decay_segments(c, P - 2, P + 3) == [(P - 2, P, False), (P, P + 3, False)]   # padding: no decay


def test_tensor_at_names_the_first_and_last_element_of_every_tensor_and_none_for_the_padding():
    c = GPT2Config(max_seq_len=8, vocab_size=10, padded_vocab_size=16, num_layers=2, num_heads=2, channels=4)
    for name, (offset, size) in param_offsets(c).items():
        assert tensor_at(c, offset) == tensor_at(c, offset + size - 1) == name
    assert tensor_at(c, c.num_parameters) is None
