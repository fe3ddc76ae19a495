"""GPT-2 BPE and the data scripts: tiny Shakespeare shards identical to llm.c's, gpt2_tokenizer.bin,
HellaSwag, and what every script refuses.

Needs the local GPT-2 ranks and corpus: $GPT2_VOCAB and $TINYSHAKESPEARE, else ../shared/data beside the
repo."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from data import PrepError, outputs
from llm import formats
from llm.tokenizer import Tokenizer, TokenizerFile
from conftest import REPO
from prep_scripts import VOCAB, assert_one_line_error, needs_vocab, run_script

SHARED = os.path.join(REPO, "..", "shared", "data")
CORPUS = os.environ.get("TINYSHAKESPEARE") or os.path.join(SHARED, "tinyshakespeare.txt")
EOT = 50256

needs_corpus = pytest.mark.skipif(not os.path.exists(CORPUS), reason=f"tiny Shakespeare not found at "
                                  f"{CORPUS} (set TINYSHAKESPEARE to the corpus)")


def header(path):
    return np.fromfile(path, dtype="<i4", count=256)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(VOCAB)


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """Run python -m data.tinyshakespeare once: the output paths and what it printed."""
    out = tmp_path_factory.mktemp("tinyshakespeare")
    tok = out / "gpt2_tokenizer.bin"
    proc = run_script("tinyshakespeare", ["--input", CORPUS, "--vocab", VOCAB, "--out", str(out),
                                             "--tokenizer", str(tok)], cwd=out)
    assert proc.returncode == 0, proc.stderr
    return dict(train=out / "tiny_shakespeare_train.bin", val=out / "tiny_shakespeare_val.bin",
                tokenizer=tok, stdout=proc.stdout)


@needs_vocab
def test_hello_world_is_15496_995(tokenizer):
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert tokenizer.decode([15496, 995]) == "Hello world"
    assert tokenizer.eot == EOT
    assert tokenizer.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]   # plain text, not EOT
    assert tokenizer.encode_batch(["Hello world", " world"]) == [[15496, 995], [995]]


@needs_vocab
@needs_corpus
def test_tinyshakespeare_gives_llmc_shards_of_305260_train_and_32768_val_tokens(shakespeare):
    for split, ntok in (("train", 305260), ("val", 32768)):
        assert header(shakespeare[split])[:3].tolist() == [20240520, 1, ntok]
        assert os.path.getsize(shakespeare[split]) == 1024 + 2 * ntok
        assert len(formats.read_shard(shakespeare[split])) == ntok
    stdout = shakespeare["stdout"]
    assert f"writing 32,768 tokens to {shakespeare['val']} (66,560 bytes) in the gpt-2 format" in stdout
    assert f"writing 305,260 tokens to {shakespeare['train']} (611,544 bytes)" in stdout
    assert "tokenized 7,222/7,222 sections (338,028 tokens)" in stdout


@needs_vocab
@needs_corpus
def test_every_section_is_eot_then_its_text_with_its_blank_line(shakespeare, tokenizer):
    tokens = np.concatenate([formats.read_shard(shakespeare[split]) for split in ("val", "train")])
    assert tokens[0] == EOT
    starts = np.flatnonzero(tokens == EOT)   # the text itself never encodes to EOT
    documents = [tokenizer.decode(d[1:].tolist()) for d in np.split(tokens, starts[1:])]
    sections = Path(CORPUS).read_text(encoding="utf-8").split("\n\n")
    assert len(starts) == len(sections) == 7222
    assert documents == [s + "\n\n" for s in sections[:-1]] + sections[-1:]


@needs_vocab
@needs_corpus
def test_val_split_decodes_to_the_start_of_the_corpus(shakespeare):
    val = formats.read_shard(shakespeare["val"])
    text = TokenizerFile(shakespeare["tokenizer"]).decode(val[1:7].tolist())
    assert text == "First Citizen:\nBefore we"


@needs_vocab
@needs_corpus
def test_tokenizer_file_decodes_exactly_as_tiktoken(shakespeare, tokenizer):
    assert header(shakespeare["tokenizer"])[:4].tolist() == [20240328, 2, 50257, EOT]
    decoder = TokenizerFile(shakespeare["tokenizer"], expected_vocab=50257)
    assert decoder.eot == EOT and decoder.token_bytes == tokenizer.token_bytes()
    sample = formats.read_shard(shakespeare["train"])[:2000].tolist()
    assert decoder.decode(sample) == tokenizer.decode(sample)
    # a character split across tokens: alone, a piece decodes as U+FFFD in both
    emoji = tokenizer.encode("caf\u00e9 \U0001F600")
    for ids in (emoji, emoji[-1:], [EOT]):
        assert decoder.decode(ids) == tokenizer.decode(ids)
    assert decoder.decode(emoji) == "caf\u00e9 \U0001F600" and "\ufffd" in decoder.decode(emoji[-1:])


def test_missing_input_is_one_line_and_exit_1(tmp_path):
    missing = tmp_path / "missing.txt"
    proc = run_script("tinyshakespeare", ["--input", str(missing), "--out", str(tmp_path)], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == f"error: {missing}: no such file\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_input_without_text_is_one_line_and_writes_nothing(tmp_path, text):
    """Once a train shard of 0 tokens, and exit 0."""
    empty = tmp_path / "input.txt"
    empty.write_text(text)
    out = tmp_path / "out"
    proc = run_script("tinyshakespeare", ["--input", empty, "--out", out, "--tokenizer", out / "tok.bin"],
                      cwd=tmp_path)
    assert_one_line_error(proc, f"error: {empty}: empty (no text in it): nothing to prepare")
    assert not out.exists()


@needs_vocab
def test_an_input_shorter_than_the_val_split_is_one_line_and_writes_nothing(tmp_path):
    """Once a val shard of all its tokens, a train shard of none, and exit 0."""
    short = tmp_path / "input.txt"
    short.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n")
    out = tmp_path / "out"
    proc = run_script("tinyshakespeare", ["--input", short, "--vocab", VOCAB, "--out", out, "--tokenizer",
                                          out / "tok.bin"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {short}: 26 tokens, and the first 32,768 are the val split: nothing "
                                f"is left to train on")
    assert not out.exists()


@needs_corpus
def test_missing_vocab_is_one_line_and_exit_1(tmp_path):
    missing = tmp_path / "gpt2.tiktoken"
    proc = run_script("tinyshakespeare", ["--input", CORPUS, "--vocab", str(missing), "--out", str(tmp_path)],
                      cwd=tmp_path)
    assert proc.returncode == 1
    hint = "pass --vocab PATH to a gpt2.tiktoken file or set GPT2_VOCAB"
    assert proc.stderr == f"error: {missing}: no such file: {hint}\n"
    for script in ("hellaswag", "fineweb", "gpt2"):   # before the download each would start without --input
        proc = run_script(script, ["--vocab", missing, "--out", tmp_path / "out"], cwd=tmp_path)
        assert_one_line_error(proc, f"error: {missing}: no such file: {hint}\n")


@pytest.mark.parametrize("script, variable, flag", [
    ("tinyshakespeare", "TINYSHAKESPEARE", "--input"), ("tinyshakespeare", "GPT2_VOCAB", "--vocab"),
    ("hellaswag", "GPT2_VOCAB", "--vocab"), ("fineweb", "GPT2_VOCAB", "--vocab"),
    ("gpt2", "GPT2_VOCAB", "--vocab"),
])
def test_a_path_from_an_environment_variable_that_names_no_file_is_one_line_naming_it(tmp_path, script,
                                                                                       variable, flag):
    """Once "error: missing: no such file: pass --vocab PATH ... or set GPT2_VOCAB", which was set, and for
    TINYSHAKESPEARE no word of where the path came from."""
    missing = tmp_path / "missing"
    proc = run_script(script, ["--out", tmp_path / "out"], cwd=tmp_path, environ={variable: str(missing)})
    assert_one_line_error(proc, f"error: {missing} (${variable}): no such file: fix or unset {variable}, or "
                                f"pass {flag} PATH\n")
    assert os.listdir(tmp_path) == []



@pytest.mark.parametrize("script", ["tinyshakespeare", "hellaswag", "fineweb", "gpt2"])
def test_an_out_that_cannot_be_a_folder_is_one_line_before_any_work(tmp_path, script):
    """Once "error: PATH: File exists" once the work was done (fineweb: once shard 0, 10^8 tokens, was full),
    or a line naming a temporary file. No --input: the check comes before any download."""
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    below = "a part of the path is a file, not a folder: choose another place"
    for out, problem in ((a_file, "exists and is not a folder: name a folder"), (a_file / "out", below)):
        proc = run_script(script, ["--out", out], cwd=tmp_path)
        assert_one_line_error(proc, f"error: --out {out}: {problem}\n")
    assert os.listdir(tmp_path) == ["a_file"] and a_file.read_text() == "kept"


def test_a_tokenizer_that_cannot_be_written_is_one_line_before_the_shards(tmp_path):
    """Once both shards were written first, and the line then named a temporary file."""
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    tokenizer = a_file / "gpt2_tokenizer.bin"
    proc = run_script("tinyshakespeare", ["--input", CORPUS, "--vocab", VOCAB, "--out", tmp_path / "out",
                                          "--tokenizer", tokenizer], cwd=tmp_path)
    assert_one_line_error(proc, f"error: --tokenizer {tokenizer}: a part of the path is a file, not a "
                                f"folder: choose another place\n")
    assert os.listdir(tmp_path) == ["a_file"]


def test_a_run_that_fails_removes_the_files_it_wrote_and_the_folders_it_made(tmp_path):
    """data.outputs, through which every script writes; a file that was there before the run stays, the
    one it did not write and the one it wrote anew (as make data's gpt2_tokenizer.bin, which data.gpt2
    writes again)."""
    (tmp_path / "earlier.bin").write_bytes(b"an earlier run's")
    (tmp_path / "tok.bin").write_bytes(b"an earlier run's")
    made = tmp_path / "new" / "folder"
    with pytest.raises(PrepError, match="found half way"):
        with outputs(str(tmp_path), ("--tokenizer", str(made / "tok.bin"))) as written:
            assert made.is_dir()   # made by the check, before any work
            for name in ("val.bin", "tok.bin"):
                (tmp_path / name).write_bytes(b"this run's")
                written.append(str(tmp_path / name))
            raise PrepError("a bad input found half way")
    assert sorted(os.listdir(tmp_path)) == ["earlier.bin", "tok.bin"]


HELLASWAG = [
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.",
     "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain", "label": 3,
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."]},
    {"ind": 92, "ctx": "A woman is outside with a bucket and a dog.", "label": 0,
     "endings": ["She rinses the bucket off.", "She jumps in.", "She paints.", "She leaves."]},
    {"ind": 106, "ctx": "Two people play tennis", "label": 2,
     "endings": ["well", "badly", "all day", "at night"]},
]


@needs_vocab
def test_hellaswag_examples_are_context_and_space_led_endings(tmp_path, tokenizer):
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text("".join(json.dumps(e) + "\n" for e in HELLASWAG))
    out = tmp_path / "hellaswag"
    proc = run_script("hellaswag", ["--input", str(jsonl), "--vocab", VOCAB, "--out", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = out / "hellaswag_val.bin"
    assert f"writing 3 examples to {path}" in proc.stdout
    assert header(path)[:3].tolist() == [20240522, 1, 3]
    examples = formats.read_eval(path)
    assert [e["label"] for e in examples] == [3, 0, 2]
    assert examples[0]["context"] == tokenizer.encode("A man is sitting on a roof. he")
    assert examples[0]["completions"][3] == tokenizer.encode(" starts pulling up roofing on a roof.")
    assert examples[2]["completions"] == [[880], [11234], [477, 1110], [379, 1755]]   # " well", " badly", ...
    for example in examples:
        assert all(tokenizer.decode(c[:1]).startswith(" ") for c in example["completions"])


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_hellaswag_without_examples_is_one_line_and_writes_nothing(tmp_path, text):
    """Once an eval file of 0 examples, on which -h 1 then divided by 0."""
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text(text)
    proc = run_script("hellaswag", ["--input", jsonl, "--out", tmp_path / "out"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {jsonl}: empty (no text in it): nothing to prepare")
    assert not (tmp_path / "out").exists()


@needs_vocab
def test_hellaswag_bad_line_names_the_line(tmp_path):
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text(json.dumps(HELLASWAG[0]) + "\n" + json.dumps({"ctx": "x", "label": 1}) + "\n")
    args = ["--input", str(jsonl), "--vocab", VOCAB, "--out", str(tmp_path)]
    proc = run_script("hellaswag", args, cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: {jsonl} line 2: not a HellaSwag example (KeyError: 'endings'): correct "
                           f"or remove the line\n")


@needs_vocab
def test_hellaswag_example_without_a_context_is_one_line_naming_its_line(tmp_path):
    """Once written, and then refused by train_gpt2.py -h 1 ("example 1 has an empty context")."""
    jsonl = tmp_path / "hellaswag_val.jsonl"
    jsonl.write_text(json.dumps(HELLASWAG[0]) + "\n" + json.dumps({**HELLASWAG[1], "ctx": ""}) + "\n")
    args = ["--input", jsonl, "--vocab", VOCAB, "--out", tmp_path / "out"]
    assert_one_line_error(run_script("hellaswag", args, cwd=tmp_path),
                          f"error: {jsonl} line 2: not a HellaSwag example (ValueError: its ctx is empty, "
                          f"and -h 1 scores each ending after the context): correct or remove the line\n")
    assert os.listdir(tmp_path) == ["hellaswag_val.jsonl"]


@pytest.mark.parametrize("fields, problem", [
    ('{"n_head": 1e999}', "n_head is Infinity"),    # once an OverflowError traceback from int()
    ('{"n_head": 0}', "n_head is 0"),               # once C / 64 heads, in a file named for them
    ('{"n_head": 4.7}', "n_head is 4.7"),           # once 4 heads
    ('{"n_head": 4, "n_layer": "1"}', 'n_layer is "1"'),
])
def test_a_config_json_size_that_is_not_a_positive_integer_is_one_line_naming_it(tmp_path, fields, problem):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    model = tmp_path / "model"
    model.mkdir()
    tensors = {"wte.weight": (10, 8), "wpe.weight": (4, 8), "h.0.ln_1.weight": (8,)}   # L=1, C=8, V=10
    safetensors_numpy.save_file({name: np.zeros(shape, np.float32) for name, shape in tensors.items()},
                                str(model / "model.safetensors"))
    (model / "config.json").write_text(fields)
    proc = run_script("gpt2", ["--input", model, "--out", tmp_path / "out"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {model / 'config.json'}: {problem}, not an integer of 1 or more: "
                                f"correct it in the file\n")
    assert sorted(os.listdir(tmp_path)) == ["model"]
