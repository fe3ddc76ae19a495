"""python -m llm.sample: text from a checkpoint or a run's directory, with a seed, a temperature and top-k;
-g (train_gpt2.py's flag) or -n new tokens; bounded generation.

The model is a tiny random GPT-2 over a 96-token vocabulary: the 95 printable ASCII characters, then EOT,
so that what the sampler prints can be decoded by hand."""
import subprocess
import sys

import numpy as np
import pytest

from llm import formats
from llm.backends import get_backend
from llm.config import GPT2Config
from llm.layout import ParamViews
from llm.model import GPT2
from llm.sample import Rng, generate, sample
from llm.weight_init import init_params
from reference import gpt2 as ref
from conftest import env
from prep_scripts import VOCAB, needs_vocab

CHARS = [bytes([c]) for c in range(32, 127)]
EOT = len(CHARS)   # 95, the last token
CONFIG = GPT2Config(max_seq_len=32, vocab_size=EOT + 1, padded_vocab_size=128, num_layers=2, num_heads=2,
                    channels=32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A random model and a tokenizer file for it, in a scratch directory."""
    folder = tmp_path_factory.mktemp("sample")
    formats.write_model(folder / "model.bin", CONFIG, init_params(CONFIG))
    formats.write_tokenizer(folder / "tokenizer.bin", CHARS + [b"<|endoftext|>"], EOT)
    return folder


def run_sample(folder, *args):
    """python -m llm.sample on the tiny model, on the CPU; the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, "-m", "llm.sample", "-e", "model.bin", "--tokenizer",
                           "tokenizer.bin", "--backend", "numpy", *map(str, args)], cwd=folder, env=env(),
                          capture_output=True, text=True, timeout=120)


def text_of(proc):
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n")
    return proc.stdout[:-1]


def tiny_model():
    model = GPT2(CONFIG, get_backend("numpy"))
    model.load_params(init_params(CONFIG))
    return model


def test_same_seed_gives_the_same_text_and_another_seed_another(files):
    first = text_of(run_sample(files, "-n", 20, "--seed", 7, "--temperature", 2.0, "--top_k", 50))
    again = text_of(run_sample(files, "-n", 20, "--seed", 7, "--temperature", 2.0, "--top_k", 50))
    other = text_of(run_sample(files, "-n", 20, "--seed", 8, "--temperature", 2.0, "--top_k", 50))
    assert len(first) >= 20 and first == again and other != first   # each new token is a character (or EOT)


def test_top_k_1_is_greedy_decoding_by_the_reference_forward(files):
    printed = text_of(run_sample(files, "-n", 12, "--top_k", 1, "--seed", 99))
    p = ParamViews(init_params(CONFIG), CONFIG).copies(np.float64)
    tokens = [EOT]
    for _ in range(12):   # the float64 reference over exactly the tokens so far, argmax over the V real ids
        logits, _, _ = ref.gpt2_forward(p, CONFIG, np.array([tokens]))
        tokens.append(int(np.argmax(logits[0, -1, :CONFIG.vocab_size])))
    assert printed == b"".join(CHARS[t] if t < EOT else b"<|endoftext|>" for t in tokens[1:]).decode()


def test_a_tiny_temperature_is_greedy_decoding():
    """logits / 1e-300 overflowed to inf, and inf - inf made every probability NaN."""
    model = tiny_model()
    greedy = sample(model, [EOT], 12, CONFIG.max_seq_len, Rng(99), top_k=1)
    for temperature in (1e-30, 1e-300, 5e-324):
        assert sample(model, [EOT], 12, CONFIG.max_seq_len, Rng(99), temperature=temperature) == greedy


def test_defaults_print_what_training_prints(files):
    """No prompt, temperature 1, no top-k, seed 1337: llm.c's sample of -g N tokens is N-1 tokens after
    EOT."""
    printed = text_of(run_sample(files, "-g", 15))
    tokens = generate(tiny_model(), EOT, 16, CONFIG.max_seq_len)
    assert len(tokens) == 15
    assert printed == b"".join(CHARS[t] if t < EOT else b"<|endoftext|>" for t in tokens).decode()
    assert text_of(run_sample(files, "-n", 15)) == printed   # -n, the flag's earlier name, is the same flag


def test_a_run_directory_gives_its_newest_complete_checkpoint(files):
    """-e DIR reads the model of DIR's largest DONE step, as -y 1 resumes it: a newer model without DONE
    (a checkpoint being written, or cut short) is passed over. The layout is llm.c's as well as ours."""
    run = files / "run"
    run.mkdir()
    for step, seed, done in ((3, 1, True), (5, 42, True), (10, 2, False)):
        formats.write_model(run / f"model_{step:08d}.bin", CONFIG, init_params(CONFIG, seed=seed))
        if done:
            (run / f"DONE_{step:08d}").touch()
    (run / "state_00000005_00000.bin").touch()   # llm.c's per-rank state file
    printed = text_of(run_sample(files, "-e", "run", "-g", 20))
    assert printed == text_of(run_sample(files, "-e", "model.bin", "-g", 20))   # step 5's: seed 42
    assert printed != text_of(run_sample(files, "-e", "run/model_00000010.bin", "-g", 20))
    assert printed != text_of(run_sample(files, "-e", "run/model_00000003.bin", "-g", 20))


def test_a_huge_token_count_is_cut_to_the_window():
    """-g 10^9 in training: at most T tokens (EOT included) and as many forwards, never 10^9."""
    model = tiny_model()
    calls, forward = [], model.forward
    model.forward = lambda inputs: calls.append(inputs.shape) or forward(inputs)
    assert len(generate(model, EOT, 10**9, 16)) == 15 and len(calls) == 15 and max(calls) == (1, 16)
    calls.clear()
    assert len(generate(model, EOT, 10**9, 1024)) == CONFIG.max_seq_len - 1   # T above the model's maxT
    assert max(calls) == (1, CONFIG.max_seq_len)


@pytest.mark.parametrize("args, message", [
    (["-g", 40], "-g 40: EOT, the prompt's 0 tokens and the new tokens must fit the model's max_seq_len 32: "
                 "ask for -g 31 or fewer"),
    (["-g", 0], "-g 0: generate at least 1 token"),
    (["-n", 0], "-g 0: generate at least 1 token"),
    (["-g", "many"], "argument -g/-n: invalid int value: 'many'"),
    (["--temperature", 0], "--temperature 0.0: must be positive"),
    (["--top_k", -1], "--top_k -1: must be 0 (all tokens) or positive"),
    (["--seed", 0], "--seed 0: xorshift needs a seed that is not 0"),
    (["--backend", "tpu"], "unknown backend 'tpu'"),
    (["--bogus", 1], "unrecognized arguments: --bogus 1"),
    (["-e", "gpt2_124M.bin"], "gpt2_124M.bin: no such file: python -m data.gpt2 writes GPT-2's weights"),
    (["--tokenizer", "gpt2_tokenizer.bin"],
     "gpt2_tokenizer.bin: no such file: `make data` or python -m data.gpt2"),
    (["--tokenizer", "model.bin"], "model.bin: bad magic 20240326"),
    (["-e", "."], ".: a directory without a complete checkpoint (no DONE_%08d file)"),
])
def test_bad_input_is_one_line(files, args, message):
    proc = run_sample(files, *args)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr


@needs_vocab
def test_a_prompt_is_continued_and_must_fit_the_window(tmp_path):
    from llm.tokenizer import Tokenizer
    config = GPT2Config(max_seq_len=16, num_layers=1, num_heads=2, channels=16)   # GPT-2's vocabulary
    formats.write_model(tmp_path / "model.bin", config, init_params(config))
    Tokenizer(VOCAB).write_tokenizer_file(tmp_path / "tokenizer.bin")
    proc = run_sample(tmp_path, "--prompt", "Hello world", "--vocab", VOCAB, "-g", 5)   # 2 tokens: 15496, 995
    assert text_of(proc).startswith("Hello world") and len(text_of(proc)) > len("Hello world")
    proc = run_sample(tmp_path, "--prompt", "Hello world", "--vocab", VOCAB, "-g", 14)
    assert "the prompt's 2 tokens" in proc.stderr and "ask for -g 13 or fewer" in proc.stderr


def test_a_vocab_that_is_not_gpt2s_ranks_says_where_its_name_came_from_and_what_to_do(tmp_path, monkeypatch):
    """Each in one short line: tiktoken's own message quotes the line it could not parse, which in a
    binary file runs to kilobytes."""
    from llm.tokenizer import TokenizerError, get_encoding
    formats.write_tokenizer(tmp_path / "tok.bin", [b"a", b"b"], 1)
    flag_hint = "pass --vocab PATH to a gpt2.tiktoken file or set GPT2_VOCAB"
    env_hint = "fix or unset GPT2_VOCAB, or pass --vocab PATH"
    monkeypatch.delenv("GPT2_VOCAB", raising=False)
    with pytest.raises(TokenizerError) as e:
        get_encoding(str(tmp_path / "tok.bin"))
    assert str(e.value) == (f"{tmp_path / 'tok.bin'}: not a tiktoken ranks file; this is an llm.c tokenizer "
                            f"file: {flag_hint}")
    for path, problem in ((tmp_path / "missing", "no such file"), (tmp_path, "a folder, not a file")):
        monkeypatch.setenv("GPT2_VOCAB", str(path))
        with pytest.raises(TokenizerError) as e:
            get_encoding()
        assert str(e.value) == f"{path} ($GPT2_VOCAB): {problem}: {env_hint}"
