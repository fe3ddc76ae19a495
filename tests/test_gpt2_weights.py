"""python -m data.gpt2: a tiny GPT-2 in Hugging Face's exact layout becomes llm.c's model files that compute
the same logits.

The tiny model (L=2, C=64, NH=4, maxT=32, V=50257) is saved as HF does: Conv1D weights (in, out), the
causal-mask buffers, with and without the "transformer." prefix, with and without a tied lm_head.
The converted file is run through reference.gpt2; the expected logits come from a forward written
here directly on HF's tensors, x @ W with W (in, out)."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, env
from llm import formats
from llm.config import GPT2_PADDED, GPT2Config
from llm.layout import ParamViews
from prep_scripts import VOCAB, assert_one_line_error, needs_vocab, run_script
from reference.gpt2 import gpt2_backward, gpt2_forward

safetensors_numpy = pytest.importorskip("safetensors.numpy")

L, C, NH, maxT, V = 2, 64, 4, 32, 50257
TINY = GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=GPT2_PADDED, num_layers=L, num_heads=NH,
                  channels=C)


def hf_gpt2(seed=0):
    """A random GPT-2 as Hugging Face's model.safetensors holds it (names without "transformer.")."""
    rng = np.random.default_rng(seed)

    def normal(*shape, mean=0.0, std=0.1):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    t = {"wte.weight": normal(V, C), "wpe.weight": normal(maxT, C)}
    for l in range(L):
        h = f"h.{l}."
        t[h + "ln_1.weight"], t[h + "ln_1.bias"] = normal(C, mean=1.0), normal(C)
        t[h + "attn.bias"] = np.tril(np.ones((maxT, maxT), np.float32))[None, None]   # the causal-mask buffer
        t[h + "attn.c_attn.weight"], t[h + "attn.c_attn.bias"] = normal(C, 3 * C), normal(3 * C)   # (in, out)
        t[h + "attn.c_proj.weight"], t[h + "attn.c_proj.bias"] = normal(C, C), normal(C)
        t[h + "ln_2.weight"], t[h + "ln_2.bias"] = normal(C, mean=1.0), normal(C)
        t[h + "mlp.c_fc.weight"], t[h + "mlp.c_fc.bias"] = normal(C, 4 * C), normal(4 * C)
        t[h + "mlp.c_proj.weight"], t[h + "mlp.c_proj.bias"] = normal(4 * C, C), normal(C)
    t["ln_f.weight"], t["ln_f.bias"] = normal(C, mean=1.0), normal(C)
    return t


def hf_forward(t, x):
    """GPT-2's logits (B, T, V) in float64, on HF's tensors as they are: every linear layer is x @ W + b."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    B, T = x.shape
    hs = C // NH

    def layernorm(h, name):
        mean, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        return (h - mean) / np.sqrt(var + 1e-5) * t[name + ".weight"] + t[name + ".bias"]

    def linear(h, name):
        return h @ t[name + ".weight"] + t[name + ".bias"]

    def heads(a):                                                            # (B, T, C) -> (B, NH, T, hs)
        return a.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)

    h = t["wte.weight"][x] + t["wpe.weight"][:T]                             # (B, T, C)
    for l in range(L):
        p = f"h.{l}."
        q, k, v = np.split(linear(layernorm(h, p + "ln_1"), p + "attn.c_attn"), 3, axis=-1)
        scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) / math.sqrt(hs)   # (B, NH, T, T)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        y = (att @ heads(v)).transpose(0, 2, 1, 3).reshape(B, T, C)
        h = h + linear(y, p + "attn.c_proj")
        u = linear(layernorm(h, p + "ln_2"), p + "mlp.c_fc")
        gelu = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
        h = h + linear(gelu, p + "mlp.c_proj")
    return layernorm(h, "ln_f") @ t["wte.weight"].T


def convert(args, cwd, block=()):
    return run_script("gpt2", args, cwd, block)


@pytest.fixture(scope="module")
def hf():
    return hf_gpt2()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, hf):
    """HF's folder layout: model.safetensors with bare names, and config.json giving n_head."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    folder.mkdir()
    safetensors_numpy.save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_layer=L, n_head=NH, n_embd=C,
                                                        n_positions=maxT, n_ctx=maxT, vocab_size=V)))
    return folder


def save_prefixed(tmp_path, hf, lm_head=None):
    """The transformer.-prefixed names of GPT2LMHeadModel's state dict, with lm_head.weight and
    .masked_bias."""
    t = {"transformer." + k: v for k, v in hf.items()}
    for l in range(L):
        t[f"transformer.h.{l}.attn.masked_bias"] = np.array(-1e4, np.float32)
    t["lm_head.weight"] = hf["wte.weight"] if lm_head is None else lm_head
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(t, str(path))
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory, model_folder):
    out = tmp_path_factory.mktemp("llmc")
    proc = convert(["--input", str(model_folder), "--vocab", VOCAB, "--out", str(out)], cwd=out)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


@needs_vocab
def test_converted_model_computes_the_logits_of_the_hf_model(converted, hf):
    out, _ = converted
    config, params, version = formats.read_model(out / "gpt2_d2c64h4.bin")
    assert (config, version) == (TINY, 3)
    x = np.random.default_rng(1).integers(0, V, (2, maxT))
    logits, _, _ = gpt2_forward(dict(ParamViews(params, config)), config, x)
    expected = hf_forward(hf, x)
    assert np.abs(expected).max() > 1.0                          # large enough for a wrong layout to show
    np.testing.assert_allclose(logits[..., :V], expected, rtol=0, atol=1e-5)
    assert np.all(logits[..., V:] == 0)                          # the padded rows of wte are 0


@needs_vocab
def test_header_is_llmc_slots_with_vocab_padded_to_50304(converted):
    out, stdout = converted
    assert np.fromfile(out / "gpt2_d2c64h4.bin", "<i4", 8).tolist() == [20240326, 3, maxT, V, L, NH, C, 50304]
    assert np.fromfile(out / "gpt2_d2c64h4_bf16.bin", "<i4", 8).tolist() == [20240326, 5, maxT, V, L, NH, C,
                                                                              50304]
    assert "GPT-2 d2c64h4: L=2, C=64, NH=4, maxT=32, V=50257, Vp=50304: 3,321,600 parameters" in stdout
    assert f"writing {out / 'gpt2_d2c64h4_bf16.bin'} (version 5, bf16)" in stdout
    assert TINY.num_parameters == 50304 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64 == 3_321_600


@needs_vocab
def test_weights_land_in_llmc_layout_transposed_from_conv1d(converted, hf):
    out, _ = converted
    _, params, _ = formats.read_model(out / "gpt2_d2c64h4.bin")
    p = ParamViews(params, TINY)
    np.testing.assert_array_equal(p.wte[:V], hf["wte.weight"])
    np.testing.assert_array_equal(p.wte[V:], 0)
    np.testing.assert_array_equal(p.qkvw[1], hf["h.1.attn.c_attn.weight"].T)          # (3C, C) from (C, 3C)
    np.testing.assert_array_equal(p.fcprojw[0], hf["h.0.mlp.c_proj.weight"].T)        # (C, 4C) from (4C, C)
    np.testing.assert_array_equal(p.ln2b[1], hf["h.1.ln_2.bias"])
    np.testing.assert_array_equal(p.lnfw, hf["ln_f.weight"])


@needs_vocab
def test_bf16_file_is_the_fp32_file_rounded_to_bf16(converted):
    out, _ = converted
    _, fp32, _ = formats.read_model(out / "gpt2_d2c64h4.bin")
    bits = np.fromfile(out / "gpt2_d2c64h4_bf16.bin", dtype="<u2", offset=formats.HEADER_BYTES)
    np.testing.assert_array_equal(bits, formats.float32_to_bf16_bits(fp32))


@needs_vocab
def test_tokenizer_file_has_gpt2s_50257_tokens(converted):
    out, stdout = converted
    assert np.fromfile(out / "gpt2_tokenizer.bin", "<i4", 4).tolist() == [20240328, 2, 50257, 50256]
    token_bytes, eot = formats.read_tokenizer(out / "gpt2_tokenizer.bin", expected_vocab=V)
    assert token_bytes[15496] == b"Hello" and eot == 50256
    assert sorted(os.listdir(out)) == ["gpt2_d2c64h4.bin", "gpt2_d2c64h4_bf16.bin", "gpt2_tokenizer.bin"]


@needs_vocab
def test_prefixed_names_tied_lm_head_and_heads_flag_give_the_same_file(tmp_path, hf, converted):
    path = save_prefixed(tmp_path, hf)                            # no config.json beside it: NH from --heads
    proc = convert(["--input", str(path), "--heads", "4", "--vocab", VOCAB, "--out", str(tmp_path)],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out, _ = converted
    assert (tmp_path / "gpt2_d2c64h4.bin").read_bytes() == (out / "gpt2_d2c64h4.bin").read_bytes()


def test_model_flag_checks_the_sizes_and_nh_defaults_to_c_over_64(tmp_path, hf):
    path = save_prefixed(tmp_path, hf)
    proc = convert(["--input", str(path), "--model", "gpt2", "--out", str(tmp_path)], cwd=tmp_path)
    assert_one_line_error(proc, "--model gpt2 has L=12, C=768, NH=12, maxT=1024, V=50257, "
                                "but the weights have L=2, C=64, NH=1, maxT=32, V=50257")


@pytest.mark.parametrize("change, problem", [
    (lambda t: t.pop("h.1.mlp.c_fc.bias"), "missing tensor h.1.mlp.c_fc.bias"),
    (lambda t: t.update({"h.0.attn.c_attn.weight": np.zeros((3 * C, C), np.float32)}),
     "h.0.attn.c_attn.weight has shape (192, 64), expected (64, 192)"),
    (lambda t: t.update({"h.0.attn.rotary": np.zeros(4, np.float32)}), "unexpected tensor h.0.attn.rotary"),
    (lambda t: t.pop("wpe.weight"), "missing tensor wpe.weight"),
])
def test_bad_tensor_is_one_line_naming_it(tmp_path, hf, change, problem):
    t = dict(hf)
    change(t)
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(t, str(path))
    proc = convert(["--input", str(path), "--heads", "4", "--out", str(tmp_path)], cwd=tmp_path)
    assert_one_line_error(proc, f"{path}: {problem}")
    assert os.listdir(tmp_path) == ["model.safetensors"]          # nothing written


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tmp_path, hf, value):
    """Once written into gpt2_d2c64h4.bin, which every command then refused as damaged."""
    t = dict(hf)
    t["h.1.mlp.c_proj.weight"] = t["h.1.mlp.c_proj.weight"].copy()
    t["h.1.mlp.c_proj.weight"][3, 5] = value
    path = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(t, str(path))
    proc = convert(["--input", str(path), "--heads", "4", "--out", str(tmp_path)], cwd=tmp_path)
    assert_one_line_error(proc, f"{path}: h.1.mlp.c_proj.weight holds NaN or infinite values: the weights "
                                f"are damaged, or of a run that diverged")
    assert os.listdir(tmp_path) == ["model.safetensors"]          # nothing written


@pytest.mark.parametrize("heads", ["0", "-4"])
def test_heads_below_1_is_one_line(tmp_path, model_folder, heads):
    """--heads 0 once meant no --heads: NH from config.json, and the file was written."""
    proc = convert(["--input", str(model_folder), "--heads", heads, "--out", str(tmp_path)], cwd=tmp_path)
    assert_one_line_error(proc, f"error: --heads {heads}: a model has at least 1 head")
    assert os.listdir(tmp_path) == []


def test_untied_lm_head_is_refused(tmp_path, hf):
    path = save_prefixed(tmp_path, hf, lm_head=hf["wte.weight"] + 1)
    proc = convert(["--input", str(path), "--heads", "4", "--out", str(tmp_path)], cwd=tmp_path)
    assert_one_line_error(proc, "lm_head.weight differs from wte.weight")


def test_not_a_safetensors_file_or_missing_file_is_one_line(tmp_path):
    text = tmp_path / "model.safetensors"
    text.write_text("this is not a tensor file\n")
    assert_one_line_error(convert(["--input", str(text)], cwd=tmp_path), f"{text}: not a safetensors file")
    missing = tmp_path / "missing.safetensors"
    assert_one_line_error(convert(["--input", str(missing)], cwd=tmp_path), f"{missing}: no such file")
    folder = tmp_path / "empty-folder"                            # a model folder without model.safetensors
    folder.mkdir()
    assert_one_line_error(convert(["--input", str(folder)], cwd=tmp_path),
                          f"{folder / 'model.safetensors'}: no such file")


def test_config_json_that_disagrees_with_the_tensors_is_one_line(tmp_path, hf, model_folder):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(model_folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(dict(n_layer=L, n_head=NH, n_embd=128)))
    assert_one_line_error(convert(["--input", str(folder)], cwd=tmp_path), "config.json: n_embd is 128")


def test_missing_packages_say_pip_install_weights(tmp_path, model_folder):
    proc = convert(["--input", str(model_folder), "--out", str(tmp_path)], cwd=tmp_path,
                   block=["safetensors"])
    assert proc.stderr == "error: this needs the safetensors package: pip install -e \".[weights]\"\n"
    assert proc.returncode == 1
    proc = convert(["--out", str(tmp_path)], cwd=tmp_path, block=["huggingface_hub"])
    assert proc.stderr == "error: this needs the huggingface_hub package: pip install -e \".[weights]\"\n"
    assert proc.returncode == 1


def fake_hub(folder, answer):
    """A stand-in for huggingface_hub in `folder` (the script's cwd, first on its path): hf_hub_download
    prints how it was called, then returns the path `answer` or raises it when it is an exception."""
    (folder / "huggingface_hub.py").write_text(f"""
def hf_hub_download(repo_id, filename):
    print(f"hf_hub_download({{repo_id}}, {{filename}})")
    answer = {answer!r}
    if isinstance(answer, str):
        return answer
    raise OSError("Name or service not known. Check your connection.\\nRetried 5 times")
""")


def test_without_input_the_model_is_downloaded_and_checked_against_gpt2(tmp_path, model_folder):
    fake_hub(tmp_path, str(model_folder / "model.safetensors"))
    proc = convert(["--out", tmp_path], cwd=tmp_path)
    assert proc.stdout.splitlines()[-1] == "hf_hub_download(openai-community/gpt2, model.safetensors)"
    assert_one_line_error(proc, "--model gpt2 has L=12, C=768, NH=12")   # the tiny model is not gpt2


def test_offline_download_is_one_line_saying_pass_input(tmp_path):
    fake_hub(tmp_path, None)
    proc = convert(["--model", "gpt2-xl", "--out", tmp_path], cwd=tmp_path)
    assert "hf_hub_download(openai-community/gpt2-xl, model.safetensors)" in proc.stdout
    assert_one_line_error(proc, "error: cannot download openai-community/gpt2-xl (Name or service not "
                                "known): pass --input PATH to a local model.safetensors or a model folder "
                                "holding one")


# ---- --debug-state: llm.c's debug state, computed by reference/ in float64 ----

def token_shard(tmp_path, tokens):
    path = tmp_path / "val.bin"
    formats.write_shard(path, np.asarray(tokens, dtype=np.uint16))
    return path


@needs_vocab
def test_debug_state_is_the_references_first_batch_and_test_gpt2_passes_against_it(tmp_path, model_folder):
    tokens = np.random.default_rng(2).integers(0, V, 4 * maxT + 10)
    shard = token_shard(tmp_path, tokens)
    out = tmp_path / "out"
    proc = convert(["--input", str(model_folder), "--vocab", VOCAB, "--out", str(out),
                    "--debug-state", str(shard)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    config, params, _ = formats.read_model(out / "gpt2_d2c64h4.bin")
    state = formats.read_debug_state(out / "gpt2_d2c64h4_debug_state.bin", config)
    np.testing.assert_array_equal(state["x"], tokens[:4 * maxT].reshape(4, maxT))      # T = maxT = 32 < 64
    np.testing.assert_array_equal(state["y"], tokens[1:4 * maxT + 1].reshape(4, maxT))
    p = ParamViews(params, config).copies(np.float64)
    logits, loss, cache = gpt2_forward(p, config, state["x"], state["y"])
    assert state["loss"] == np.float32(loss) and 5 < loss < 20       # float64, stored as float32
    np.testing.assert_array_equal(state["logits"], logits[..., :V].astype(np.float32))
    grads = ParamViews(state["grads"], config)
    want = gpt2_backward(p, config, cache)
    for name in ("wte", "qkvw", "fcprojb", "lnfw"):
        np.testing.assert_array_equal(getattr(grads, name), want[name].astype(np.float32))
    assert np.abs(grads.wte[:V]).max() > 0 and np.all(grads.wte[V:] == 0)

    check = subprocess.run([sys.executable, os.path.join(REPO, "test_gpt2.py"), "--backend", "numpy",
                            "-e", str(out / "gpt2_d2c64h4.bin"),
                            "-ds", str(out / "gpt2_d2c64h4_debug_state.bin")],
                           cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.rstrip().endswith("overall okay: 1"), check.stdout


@pytest.mark.parametrize("tokens, problem", [
    (None, "no such file: python -m data.tinyshakespeare writes it"),
    (np.arange(4 * maxT), f"{4 * maxT} tokens, the debug batch needs {4 * maxT + 1} (B=4, T={maxT})"),
    (np.full(4 * maxT + 1, 60000), f"token id 60000 is outside the model's vocab 0..{V - 1}"),
])
def test_a_debug_batch_that_cannot_be_read_is_one_line_before_any_file_is_written(tmp_path, model_folder,
                                                                                   tokens, problem):
    shard = tmp_path / "val.bin" if tokens is None else token_shard(tmp_path, tokens)
    out = tmp_path / "out"
    proc = convert(["--input", str(model_folder), "--out", str(out), "--debug-state", str(shard)],
                   cwd=tmp_path)
    assert_one_line_error(proc, f"--debug-state {shard}: {problem}")
    assert not out.exists()
