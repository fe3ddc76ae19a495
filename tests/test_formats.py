"""llm.c's file formats: exact round trips, llm.c's header layout, and one clear error per bad input."""
from contextlib import contextmanager
import math
import os

import numpy as np
import pytest

from llm import formats
from llm.config import GPT2Config
from llm.formats import FormatError

TINY = GPT2Config(max_seq_len=16, vocab_size=37, padded_vocab_size=48, num_layers=2, num_heads=2, channels=16)


def random_params(config=TINY, seed=0):
    return np.random.default_rng(seed).standard_normal(config.num_parameters).astype(np.float32)


def header_of(path):
    return np.fromfile(path, dtype="<i4", count=256)


def set_slot(path, slot, value):
    """Overwrite one header slot of an existing file."""
    with open(path, "r+b") as f:
        f.seek(4 * slot)
        f.write(np.int32(value).tobytes())


def append_bytes(path, data):
    with open(path, "ab") as f:
        f.write(data)


def cut_bytes(path, n):
    os.truncate(path, os.path.getsize(path) - n)


@contextmanager
def raises(path, *problems):
    """Expect a FormatError: one line, starting with the file's name, saying each of `problems`."""
    with pytest.raises(FormatError) as info:
        yield
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for problem in problems:
        assert problem in message, message


# ---------------------------------------------------------------------------------------------- bf16

def test_bf16_rounds_to_nearest_even_on_hand_picked_values():
    cases = [                               # (float32 value, bf16 bits)
        (1.0, 0x3F80),
        (1 + 2**-8, 0x3F80),                # tie between 1 and 1+2^-7: to the even one, 1
        (1 + 3 * 2**-8, 0x3F82),            # tie between 1+2^-7 and 1+2^-6: to the even one, 1+2^-6
        (1 + 2**-8 + 2**-20, 0x3F81),       # just above the tie: up
        (-(1 + 2**-8), 0xBF80),
        (-(1 + 3 * 2**-8), 0xBF82),
        (-2.5, 0xC020),
        (0.0, 0x0000),
        (-0.0, 0x8000),
        (2**-149, 0x0000),                  # the smallest subnormal rounds to 0
        (np.inf, 0x7F80),
        (-np.inf, 0xFF80),
        (float(np.finfo(np.float32).max), 0x7F80),   # past bf16's largest finite value: inf
    ]
    bits = formats.float32_to_bf16_bits(np.array([x for x, _ in cases], dtype=np.float32))
    assert bits.dtype == np.uint16
    assert [hex(b) for b in bits] == [hex(b) for _, b in cases]


def test_bf16_keeps_nan_a_nan():
    # 0x7F800001 is a NaN whose payload sits only in the dropped bits: truncation would make it inf
    x = np.array([0x7FC00000, 0x7F800001, 0xFFC00000], dtype=np.uint32).view(np.float32)
    back = formats.bf16_bits_to_float32(formats.float32_to_bf16_bits(x))
    assert np.isnan(back).all()


def test_bf16_bits_to_float32_is_exact():
    bits = np.array([0x3F80, 0x3F81, 0xBF82, 0x7F80, 0x0001], dtype=np.uint16)
    x = formats.bf16_bits_to_float32(bits)
    assert x.dtype == np.float32
    assert x.tolist() == [1.0, 1 + 2**-7, -(1 + 2**-6), np.inf, 2.0**-133]
    assert (formats.float32_to_bf16_bits(x) == bits).all()   # every bf16 value is its own rounding


# ---------------------------------------------------------------------------------------------- model

def test_fp32_model_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "model.bin"
    params = random_params()
    formats.write_model(path, TINY, params)
    config, loaded, version = formats.read_model(path)
    assert (config, version) == (TINY, 3)
    assert loaded.dtype == np.float32 and loaded.shape == (7616,)
    assert loaded.tobytes() == params.tobytes()


def test_model_header_has_llmc_layout(tmp_path):
    path = tmp_path / "model.bin"
    formats.write_model(path, TINY, random_params())
    header = header_of(path)
    # magic, version, maxT, V, L, NH, C, Vp, then zeros up to our run id and checksum (see the checksum tests)
    assert header[:8].tolist() == [20240326, 3, 16, 37, 2, 2, 16, 48]
    assert not header[8:252].any() and header[252:254].tolist() == [1, 0]
    assert os.path.getsize(path) == 1024 + 4 * 7616
    assert formats.read_model(path)[::2] == (TINY, 3)


def test_bf16_model_stores_rne_bits_and_reads_them_back(tmp_path):
    path = tmp_path / "model_bf16.bin"
    params = random_params()
    formats.write_model(path, TINY, params, version=5)
    assert os.path.getsize(path) == 1024 + 2 * 7616
    assert header_of(path)[1] == 5
    stored = np.fromfile(path, dtype="<u2", offset=1024)
    assert (stored == formats.float32_to_bf16_bits(params)).all()
    config, loaded, version = formats.read_model(path)
    assert (config, version) == (TINY, 5)
    assert loaded.dtype == np.float32
    assert (loaded == formats.bf16_bits_to_float32(stored)).all()
    # a second bf16 write of what was read gives the same bytes
    again = tmp_path / "again.bin"
    formats.write_model(again, TINY, loaded, version=5)
    assert again.read_bytes() == path.read_bytes()


def test_model_errors_name_the_file_and_the_problem(tmp_path):
    path = tmp_path / "gpt2_124M.bin"
    with raises(path, "no such file"):
        formats.read_model(path)

    formats.write_shard(path, [1, 2, 3])
    with raises(path, "bad magic 20240520 (expected 20240326: an llm.c model checkpoint)",
                "this is an llm.c token data shard"):
        formats.read_model(path)

    formats.write_model(path, TINY, random_params())
    set_slot(path, 1, 4)
    with raises(path, "unknown version 4 (expected 3 (fp32) or 5 (bf16))"):
        formats.read_model(path)

    formats.write_model(path, TINY, random_params())
    cut_bytes(path, 4 * 7616 - 1000)
    with raises(path, "truncated: header says 7616 parameters (30464 bytes) but the file has 1000 bytes"):
        formats.read_model(path)

    formats.write_model(path, TINY, random_params())
    append_bytes(path, b"\0" * 8)
    with raises(path, "file size disagrees with header", "(8 extra bytes)"):
        formats.read_model(path)

    path.write_bytes(b"\0" * 100)
    with raises(path, "truncated: the file has 100 bytes, less than the 1024-byte header"):
        formats.read_model(path)

    formats.write_model(path, TINY, random_params())
    set_slot(path, 5, 3)   # 16 channels cannot split into 3 heads
    with raises(path, "header describes an impossible model", "not divisible by num_heads 3"):
        formats.read_model(path)


def test_a_model_header_whose_sizes_disagree_with_the_file_is_refused_before_the_parameters_are_read(
        tmp_path):
    """A damaged layer count would otherwise pass for a larger model, and a command would first say there is
    not enough memory for it."""
    path = tmp_path / "model.bin"
    formats.write_model(path, TINY, random_params())
    set_slot(path, 4, 100000)   # num_layers
    with raises(path, "truncated: header says", "parameters"):
        formats.read_model_config(path)


@pytest.mark.parametrize("write, read, slot, value, said", [
    (lambda p: formats.write_debug_state(p, **debug_batch()), lambda p: formats.read_debug_state(p, TINY),
     3, 0, "header says B=2, T=0, less than 1"),
    (lambda p: formats.write_tokenizer(p, TOKENS, eot_id=4), formats.read_tokenizer, 2, 0,
     "header says tokens=0, less than 1"),
    (lambda p: formats.write_shard(p, np.arange(10)), formats.read_shard, 2, -1,
     "header says tokens=-1, less than 0"),
    (lambda p: formats.write_eval(p, EXAMPLES), formats.read_eval, 2, -2,
     "header says examples=-2, longest_example_bytes="),
])
def test_a_header_size_that_no_file_can_have_is_named_as_damage(tmp_path, write, read, slot, value, said):
    path = tmp_path / "file.bin"
    write(path)
    set_slot(path, slot, value)
    with raises(path, said, "the file is damaged"):
        read(path)


def test_write_model_refuses_a_buffer_of_the_wrong_size(tmp_path):
    with pytest.raises(ValueError, match=r"shape \(7615,\), expected \(7616,\)"):
        formats.write_model(tmp_path / "m.bin", TINY, np.zeros(7615, np.float32))
    assert not (tmp_path / "m.bin").exists()


# ---------------------------------------------------------------------------------------------- shard

def test_shard_round_trip_and_header(tmp_path):
    path = tmp_path / "train_000000.bin"
    tokens = np.array([0, 1, 50256, 65535, 7], dtype=np.int64)
    formats.write_shard(path, tokens)
    assert header_of(path)[:3].tolist() == [20240520, 1, 5]
    assert os.path.getsize(path) == 1024 + 2 * 5
    assert formats.read_shard_header(path) == 5
    loaded = formats.read_shard(path)
    assert isinstance(loaded, np.memmap) and loaded.dtype == np.uint16
    assert loaded.tolist() == [0, 1, 50256, 65535, 7]


def test_empty_shard_reads_as_no_tokens(tmp_path):
    path = tmp_path / "empty.bin"
    formats.write_shard(path, np.zeros(0, np.uint16))
    assert formats.read_shard(path).shape == (0,)


def test_shard_errors(tmp_path):
    path = tmp_path / "val.bin"
    with raises(path, "token id 65536 at position 2 does not fit in uint16"):
        formats.write_shard(path, [1, 2, 65536])
    with raises(path, "token id -1 at position 0"):
        formats.write_shard(path, [-1])
    assert not path.exists()

    formats.write_shard(path, np.arange(10))
    cut_bytes(path, 2)
    with raises(path, "truncated: header says 10 tokens (20 bytes) but the file has 18 bytes of payload"):
        formats.read_shard(path)

    formats.write_shard(path, np.arange(10))
    append_bytes(path, b"\0\0")
    with raises(path, "file size disagrees with header", "(2 extra bytes)"):
        formats.read_shard_header(path)

    formats.write_shard(path, np.arange(10))
    set_slot(path, 1, 7)
    with raises(path, "unknown version 7 (expected 1)"):
        formats.read_shard(path)


# ---------------------------------------------------------------------------------------------- tokenizer

TOKENS = [b"a", b"b", b" the", bytes(range(256))[1:], b"<|endoftext|>"]


def test_tokenizer_round_trip_and_header(tmp_path):
    path = tmp_path / "tok.bin"
    formats.write_tokenizer(path, TOKENS, eot_id=4)
    assert header_of(path)[:4].tolist() == [20240328, 2, 5, 4]
    payload = path.read_bytes()[1024:]
    assert payload[:9] == b"\x01a\x01b\x04 the"
    assert len(payload) == sum(1 + len(t) for t in TOKENS)
    assert formats.read_tokenizer(path) == (TOKENS, 4)
    assert formats.read_tokenizer(path, expected_vocab=5) == (TOKENS, 4)


def test_version_1_tokenizer_implies_gpt2_eot(tmp_path):
    path = tmp_path / "tok_v1.bin"
    header = formats.new_header(20240328, 1)
    header[2] = 50257
    tokens = [str(i).encode() for i in range(50257)]
    path.write_bytes(header.tobytes() + b"".join(bytes([len(t)]) + t for t in tokens))
    loaded, eot = formats.read_tokenizer(path)
    assert eot == 50256 and loaded[12345] == b"12345" and len(loaded) == 50257

    header[2] = 5
    path.write_bytes(header.tobytes() + b"".join(bytes([len(t)]) + t for t in TOKENS))
    with raises(path, "a version 1 tokenizer must have 50257 tokens, this one has 5"):
        formats.read_tokenizer(path)


def test_tokenizer_errors(tmp_path):
    path = tmp_path / "gpt2_tokenizer.bin"
    with raises(path, "no such file"):
        formats.read_tokenizer(path)
    with raises(path, "token 1 has 0 bytes; the format stores 1 to 255"):
        formats.write_tokenizer(path, [b"a", b""], eot_id=0)
    with raises(path, "token 0 has 256 bytes"):
        formats.write_tokenizer(path, [b"x" * 256], eot_id=0)
    with raises(path, "EOT id 2 is not one of the 2 tokens"):
        formats.write_tokenizer(path, [b"a", b"b"], eot_id=2)

    formats.write_tokenizer(path, TOKENS, eot_id=4)
    with raises(path, "vocab mismatch: tokenizer has 5 tokens, model expects 50257"):
        formats.read_tokenizer(path, expected_vocab=50257)
    with raises("gpt2", "vocab mismatch: tokenizer has 50000 tokens, model expects 50257"):
        formats.check_vocab("gpt2", 50000, 50257)

    cut_bytes(path, 3)
    with raises(path, "truncated: header says 5 tokens", "ends inside token 4"):
        formats.read_tokenizer(path)

    formats.write_tokenizer(path, TOKENS, eot_id=4)
    append_bytes(path, b"\x01z")
    with raises(path, "file size disagrees with header", "(2 extra bytes)"):
        formats.read_tokenizer(path)


# ---------------------------------------------------------------------------------------------- debug state

def debug_batch(B=2, T=3, V=37, seed=1):
    rng = np.random.default_rng(seed)
    return dict(x=rng.integers(0, V, (B, T)).astype(np.int32), y=rng.integers(0, V, (B, T)).astype(np.int32),
                logits=rng.standard_normal((B, T, V)).astype(np.float32), loss=3.25,
                grads=random_params(seed=seed))


def test_debug_state_round_trip_and_header(tmp_path):
    path = tmp_path / "debug_state.bin"
    batch = debug_batch()
    formats.write_debug_state(path, **batch)
    assert header_of(path)[:4].tolist() == [20240327, 2, 2, 3]
    assert os.path.getsize(path) == 1024 + 4 * (2 * 6 + 6 * 37 + 1 + 7616)
    loaded = formats.read_debug_state(path, TINY)
    assert loaded["loss"] == 3.25
    for name in ("x", "y", "logits", "grads"):
        assert loaded[name].dtype == batch[name].dtype and loaded[name].shape == batch[name].shape
        assert loaded[name].tobytes() == batch[name].tobytes()


def test_debug_state_for_another_model_names_both_sizes(tmp_path):
    path = tmp_path / "debug_state.bin"
    formats.write_debug_state(path, **debug_batch())
    other = GPT2Config(max_seq_len=16, vocab_size=40, padded_vocab_size=48, num_layers=2, num_heads=2,
                       channels=16)
    expected = 4 * (2 * 6 + 6 * 40 + 1 + 7616)
    actual = 4 * (2 * 6 + 6 * 37 + 1 + 7616)
    with raises(path, "B=2, T=3; the model has V=40 and 7616 parameters", f"({expected} bytes)",
                f"the file has {actual} bytes of payload"):
        formats.read_debug_state(path, other)


# ---------------------------------------------------------------------------------------------- eval

EXAMPLES = [
    dict(label=2, context=[10, 11, 12], completions=[[1], [2, 3], [4, 5, 6], [7]]),
    dict(label=0, context=[20], completions=[[8, 9], [30], [31], [32, 33]]),
]


def test_eval_round_trip_and_layout(tmp_path):
    path = tmp_path / "hellaswag_val.bin"
    formats.write_eval(path, EXAMPLES)
    # first example: 5 fixed fields + ctx (1+3) + completions (2+3+4+2) = 20 uint16 = 40 bytes
    first = [65535, 40, 0, 2, 4, 3, 10, 11, 12, 1, 1, 2, 2, 3, 3, 4, 5, 6, 1, 7]
    second_bytes = 2 * (5 + 2 + 3 + 2 + 2 + 3)
    assert header_of(path)[:4].tolist() == [20240522, 1, 2, max(40, second_bytes)]
    assert np.fromfile(path, dtype="<u2", offset=1024)[:20].tolist() == first
    assert formats.read_eval(path) == EXAMPLES


def test_eval_errors(tmp_path):
    path = tmp_path / "hellaswag_val.bin"
    formats.write_eval(path, EXAMPLES)
    with open(path, "r+b") as f:                     # break the second example's start marker
        f.seek(1024 + 40)
        f.write(np.uint16(7).tobytes())
    with raises(path, "example 1 (at payload byte 40): start marker 7, expected 65535"):
        formats.read_eval(path)

    formats.write_eval(path, EXAMPLES)
    with open(path, "r+b") as f:                     # the second example claims index 5
        f.seek(1024 + 40 + 4)
        f.write(np.uint16(5).tobytes())
    with raises(path, "example 1", "example_index 5, expected 1"):
        formats.read_eval(path)

    formats.write_eval(path, EXAMPLES)
    set_slot(path, 2, 3)
    with raises(path, "truncated: header says 3 examples but the file holds only 2"):
        formats.read_eval(path)

    formats.write_eval(path, EXAMPLES)
    append_bytes(path, b"\xff\xff")
    with raises(path, "file size disagrees with header", "(2 extra bytes)"):
        formats.read_eval(path)

    formats.write_eval(path, EXAMPLES)
    cut_bytes(path, 4)
    with raises(path, "example 1", "truncated: the example says 34 bytes, the file has 30 left"):
        formats.read_eval(path)

    with raises(path, "must fit in uint16"):
        formats.write_eval(path, [dict(label=0, context=[70000], completions=[[1], [2], [3], [4]])])


# ---------------------------------------------------------------------------------------------- state

def optimizer_state(n=7616, seed=2):
    """m, v and master: v, AdamW's second moment, is never negative."""
    rng = np.random.default_rng(seed)
    m, v, master = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    return m, np.abs(v), master


def test_state_round_trip_with_master_and_llmc_slots(tmp_path):
    path = tmp_path / "state.bin"
    m, v, master = optimizer_state()
    formats.write_state(path, step=120, num_processes=4, rng_state=2**63 + 5, loader_state=(3, 2**40 + 1),
                        m=m, v=v, master=master, should_shuffle=True, rng_state_last_update=2**33)
    header = header_of(path)
    assert header[:6].tolist() == [20240527, 1, 4, 0, 1, 1]   # magic, version, N, rank, master, shuffle
    assert header[10] == 120
    assert header[20:24].view("<u8").tolist() == [2**63 + 5, 2**33]
    assert header[30:34].view("<i8").tolist() == [3, 2**40 + 1]
    assert header[40:42].view("<i8").tolist() == [7616]
    assert os.path.getsize(path) == 1024 + 3 * 4 * 7616
    state = formats.read_state(path, 7616)
    assert {k: state[k] for k in ("step", "num_processes", "process_rank", "should_shuffle", "rng_state",
                                  "rng_state_last_update", "loader_state")} == dict(
        step=120, num_processes=4, process_rank=0, should_shuffle=True, rng_state=2**63 + 5,
        rng_state_last_update=2**33, loader_state=(3, 2**40 + 1))
    for name, buffer in (("m", m), ("v", v), ("master", master)):
        assert state[name].tobytes() == buffer.tobytes()


def test_state_without_master(tmp_path):
    path = tmp_path / "state.bin"
    m, v, _ = optimizer_state()
    formats.write_state(path, step=7, num_processes=1, rng_state=1, loader_state=(0, 9), m=m, v=v,
                        should_shuffle=False)
    assert header_of(path)[4:6].tolist() == [0, 0]
    assert os.path.getsize(path) == 1024 + 2 * 4 * 7616
    state = formats.read_state(path, 7616)
    assert state["master"] is None and state["should_shuffle"] is False and state["step"] == 7
    assert state["m"].tobytes() == m.tobytes() and state["v"].tobytes() == v.tobytes()


def test_state_keeps_the_data_shape_and_the_outlier_windows_after_llmcs_payload(tmp_path):
    path = tmp_path / "state.bin"
    m, v, master = optimizer_state()
    # the windows see NaN steps too
    loss_window, norm_window = [10.5, float("nan"), 9.25], [1.5 + 2**-40] * 128
    formats.write_state(path, step=130, num_processes=1, rng_state=0, loader_state=(0, 130), m=m, v=v,
                        master=master, samples_per_epoch=2**33 + 1, seq_len=64, nonfinite_streak=2,
                        loss_window=loss_window, norm_window=norm_window)
    header = header_of(path)
    assert header[42:44].view("<i8").tolist() == [2**33 + 1] and header[44:48].tolist() == [64, 2, 3, 128]
    assert os.path.getsize(path) == 1024 + 3 * 4 * 7616 + 8 * (3 + 128)   # float64 windows after master
    state = formats.read_state(path, 7616)
    assert (state["samples_per_epoch"], state["seq_len"], state["nonfinite_streak"]) == (2**33 + 1, 64, 2)
    assert state["loss_window"][::2] == [10.5, 9.25] and math.isnan(state["loss_window"][1])
    assert state["norm_window"] == norm_window   # exactly: the z-scores of a resumed run depend on every bit


def test_state_written_before_the_windows_existed_reads_with_empty_windows(tmp_path):
    path = tmp_path / "state.bin"
    m, v, _ = optimizer_state()
    formats.write_state(path, step=7, num_processes=1, rng_state=1, loader_state=(0, 9), m=m, v=v)
    assert header_of(path)[42:48].tolist() == [0] * 6 and os.path.getsize(path) == 1024 + 2 * 4 * 7616
    state = formats.read_state(path, 7616)
    assert (state["seq_len"], state["samples_per_epoch"], state["loss_window"], state["norm_window"],
            state["nonfinite_streak"]) == (0, 0, [], [], 0)


def test_model_and_state_files_holding_values_no_run_makes_are_refused(tmp_path):
    path = tmp_path / "model.bin"
    params = random_params()
    params[TINY.padded_vocab_size * TINY.channels + 3] = np.inf   # in wpe, just after wte
    formats.write_model(path, TINY, params)
    with raises(path, "the model holds NaN or infinite values (1, the first in wpe): the file is damaged"):
        formats.read_model(path)
    formats.write_model(path, TINY, params, version=5)
    with raises(path, "the model holds NaN or infinite values (1, the first in wpe)"):
        formats.read_model(path)
    path = tmp_path / "state.bin"
    cases = [("m", 5, np.nan, "m holds NaN or infinite values (1, the first at index 5)"),
             ("master", 0, -np.inf, "master holds NaN or infinite values (1, the first at index 0)"),
             ("v", 9, -1e-3, "v holds negative values (1)")]
    for name, index, value, problem in cases:
        buffers = dict(zip(("m", "v", "master"), optimizer_state()))
        buffers[name][index] = value
        formats.write_state(path, step=1, num_processes=1, rng_state=0, loader_state=(0, 0), **buffers)
        with raises(path, problem, "the file is damaged"):
            formats.read_state(path, 7616)


def test_state_errors(tmp_path):
    path = tmp_path / "state_00000120.bin"
    m, v, master = optimizer_state()
    formats.write_state(path, step=1, num_processes=1, rng_state=1, loader_state=(0, 0), m=m, v=v,
                        master=master)
    with raises(path, "state is for a model with 7616 parameters, but this model has 124475904"):
        formats.read_state(path, GPT2Config().num_parameters)   # d12's
    cut_bytes(path, 4)
    with raises(path, "truncated: header says m, v and master of 7616 parameters (91392 bytes)",
                "91388 bytes of payload"):
        formats.read_state(path, 7616)
    formats.write_model(path, TINY, random_params())
    with raises(path, "bad magic 20240326 (expected 20240527: an llm.c training state file)",
                "this is an llm.c model checkpoint"):
        formats.read_state(path, 7616)


# ---------------------------------------------------------------------------------------------- atomic writes

class Crash(Exception):
    pass


def test_a_crashed_write_leaves_no_file(tmp_path):
    path = tmp_path / "model.bin"
    with pytest.raises(Crash):
        with formats.atomic_write(path) as f:
            f.write(b"half a header")
            raise Crash
    assert os.listdir(tmp_path) == []


def test_a_crashed_rewrite_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.bin"
    params = random_params()
    formats.write_model(path, TINY, params)
    before = path.read_bytes()

    def crash_after_header(f, array, dtype):
        raise Crash
    monkeypatch.setattr(formats, "_write_array", crash_after_header)
    with pytest.raises(Crash):
        formats.write_model(path, TINY, params * 2)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.bin"]
    monkeypatch.undo()
    assert formats.read_model(path)[1].tobytes() == params.tobytes()


def test_a_write_that_cannot_start_names_the_file_not_its_temporary_name(tmp_path):
    path = tmp_path / "no such folder" / "model.bin"
    with pytest.raises(FileNotFoundError) as e:
        with formats.atomic_write(path) as f:
            f.write(b"never")
    assert e.value.filename == str(path)


# ---------------------------------------------------------------------------------------------- checksums

def flip_bits(path, byte_offsets, mask=0x10):
    """Flip one bit in each of the bytes at `byte_offsets` of a file, in place."""
    with open(path, "r+b") as f:
        for offset in byte_offsets:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ mask]))


def drop_checksum(path):
    """Zero header slots 250-255, as in a file llm.c wrote: no run id, no checksum."""
    for slot in range(250, 256):
        set_slot(path, slot, 0)


def test_model_and_state_files_record_their_checksum_and_run_id(tmp_path):
    """Slot 252 says xxh3_64, 254-255 hold it: the hash of the whole file with those two slots read as 0."""
    import xxhash
    path = tmp_path / "model.bin"
    checksum = formats.write_model(path, TINY, random_params(), run_id=2**63 + 7)
    header = header_of(path)
    assert header[250:252].view("<u8")[0] == 2**63 + 7 and header[252] == 1
    assert header[254:256].view("<u8")[0] == checksum == formats.model_checksum(path)
    data = bytearray(path.read_bytes())
    data[4 * 254:4 * 256] = bytes(8)
    assert xxhash.xxh3_64(bytes(data)).intdigest() == checksum
    path = tmp_path / "state.bin"
    m, v, master = optimizer_state()
    checksum = formats.write_state(path, step=3, num_processes=1, rng_state=0, loader_state=(0, 3), m=m, v=v,
                                   model_checksum=2**64 - 1, run_id=5)
    state = formats.read_state(path, 7616)
    assert (state["checksum"], state["model_checksum"], state["run_id"]) == (checksum, 2**64 - 1, 5)
    assert header_of(path)[48:50].view("<u8")[0] == 2**64 - 1


@pytest.mark.parametrize("damage, where", [
    (lambda path: flip_bits(path, [1024 + 4 * 100 + 2]), "one bit of a parameter"),
    (lambda path: flip_bits(path, [4 * 100]), "one bit of an unused header slot"),
    (lambda path: flip_bits(path, [4 * 255 + 3]), "one bit of the checksum itself"),
    (lambda path: flip_bits(path, [4 * 252]), "the checksum's kind"),
    (lambda path: set_slot(path, 252, 0), "the checksum's kind, zeroed"),
])
def test_a_model_file_that_does_not_match_its_checksum_is_refused(tmp_path, damage, where):
    path = tmp_path / "model.bin"
    formats.write_model(path, TINY, random_params(), version=5)
    damage(path)
    with raises(path, "the file is damaged"):
        formats.read_model(path)


@pytest.mark.parametrize("damage", [
    lambda path: flip_bits(path, 1024 + 4 * np.arange(0, 2000, 2), mask=0x01),   # 1,000 words of m, low bits
    lambda path: flip_bits(path, [1024 + 4 * 7616 + 4 * 50]),                     # one word of v
    lambda path: set_slot(path, 32, 4),                                            # the data position
    lambda path: set_slot(path, 10, 4),                                            # the step
])
def test_a_state_file_that_does_not_match_its_checksum_is_refused(tmp_path, damage):
    """Each of these leaves values a run could have made: only the checksum tells them apart."""
    path = tmp_path / "state.bin"
    m, v, _ = optimizer_state()
    formats.write_state(path, step=3, num_processes=1, rng_state=0, loader_state=(0, 3), m=m, v=v)
    damage(path)
    with raises(path, "its bytes do not match the checksum it records", "the file is damaged"):
        formats.read_state(path, 7616)


def test_files_without_a_checksum_load_as_llmc_wrote_them(tmp_path):
    path = tmp_path / "model.bin"
    params = random_params()
    formats.write_model(path, TINY, params)
    drop_checksum(path)
    flip_bits(path, [1024 + 4 * 100 + 2])        # unseen without a checksum
    assert formats.model_checksum(path) is None
    assert (formats.read_model(path)[1] != params).sum() == 1
    path = tmp_path / "state.bin"
    m, v, _ = optimizer_state()
    formats.write_state(path, step=3, num_processes=1, rng_state=0, loader_state=(0, 3), m=m, v=v)
    drop_checksum(path)
    state = formats.read_state(path, 7616)
    assert state["m"].tobytes() == m.tobytes() and (state["model_checksum"], state["run_id"]) == (None, 0)


@pytest.mark.parametrize("checksummed", [True, False])
def test_a_model_of_zeros_is_refused(tmp_path, checksummed):
    """A file zero-filled by a crash: every gradient would be 0 and the run would never move."""
    path = tmp_path / "model.bin"
    formats.write_model(path, TINY, random_params())
    with open(path, "r+b") as f:
        f.seek(1024)
        f.write(bytes(4 * 7616))
    if not checksummed:
        drop_checksum(path)
    with raises(path, "its bytes do not match the checksum" if checksummed else "every parameter is 0"):
        formats.read_model(path)
