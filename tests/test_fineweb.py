"""data/fineweb.py on local files: llm.c's shard names and headers, EOT + tokens of every document in order,
the same files whatever the number of workers, and one line for each bad input.

Runs without the datasets package (and hides it when installed): local .txt and .jsonl need none. The stream
tests put a stand-in for it in the scripts' folder, and hide tqdm, whose progress bar would share stderr."""
import json
import os

import numpy as np
import pytest

from llm import formats
from llm.tokenizer import Tokenizer
from prep_scripts import VOCAB, assert_one_line_error, needs_vocab, run_script

EOT = 50256
SHARD_SIZE = 100
NO_DATA_PACKAGES = ["datasets", "pyarrow", "tqdm"]
PHRASES = ["the quick brown fox", "jumps over", "caf\u00e9 \U0001F600", "<|endoftext|> is text here",
           "line\nbreak"]
DOCUMENTS = [f"Document {i}: " + " ".join(PHRASES[: 1 + i % 5]) * (1 + i % 7) for i in range(40)]
TXT = "A whole file is one document.\n\nEven with blank lines in it.\n"


def fineweb(args, cwd, block=NO_DATA_PACKAGES):
    return run_script("fineweb", args, cwd, block)


def shard_names(out):
    """The files in `out`, in shard order (val_000000 sorts after train_* by name)."""
    return sorted(os.listdir(out), key=lambda name: name[-10:])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    jsonl = folder / "docs.jsonl"
    lines = [json.dumps({"id": i, "text": text}) for i, text in enumerate(DOCUMENTS)]
    jsonl.write_text("\n".join(lines[:20] + [""] + lines[20:]) + "\n")   # a blank line is skipped
    txt = folder / "doc.txt"
    txt.write_text(TXT)
    return [jsonl, txt]


@pytest.fixture(scope="module")
def expected():
    """EOT, then the tokens, of each document in order: the jsonl's 40, then the txt."""
    tokenizer = Tokenizer(VOCAB)
    return np.concatenate([[EOT] + tokenizer.encode(text) for text in DOCUMENTS + [TXT]])


@pytest.fixture(scope="module")
def shards(tmp_path_factory, inputs):
    """The shards from 1 and from 2 workers: {workers: (out dir, stdout)}."""
    runs = {}
    for workers in (1, 2):
        out = tmp_path_factory.mktemp(f"fineweb{workers}")
        args = ["--input", *inputs, "--vocab", VOCAB, "--out", out, "--shard_size", SHARD_SIZE,
                "--workers", workers]
        proc = fineweb(args, cwd=out)
        assert proc.returncode == 0, proc.stderr
        runs[workers] = out, proc.stdout
    return runs


@needs_vocab
def test_shards_are_val_then_train_of_shard_size_tokens(shards, expected):
    out, stdout = shards[1]
    n = -(-len(expected) // SHARD_SIZE)
    assert n >= 5
    names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n)]
    assert shard_names(out) == names
    sizes = [formats.read_shard_header(out / name) for name in names]
    assert sizes == [SHARD_SIZE] * (n - 1) + [len(expected) - SHARD_SIZE * (n - 1)]
    assert np.fromfile(out / names[1], "<i4", 3).tolist() == [20240520, 1, SHARD_SIZE]
    assert f"writing 100 tokens to {out / names[0]} (1,224 bytes) in the gpt-2 format" in stdout
    assert f"tokenized 41 documents: {len(expected):,} tokens in {n} shards in {out}" in stdout


@needs_vocab
def test_shards_hold_eot_and_the_tokens_of_each_document_in_order(shards, expected):
    out, _ = shards[1]
    tokens = np.concatenate([formats.read_shard(out / name) for name in shard_names(out)])
    np.testing.assert_array_equal(tokens, expected)
    assert np.count_nonzero(tokens == EOT) == 41            # "<|endoftext|>" in a text is text, not EOT


@needs_vocab
def test_one_and_two_workers_write_identical_files(shards):
    (out1, _), (out2, _) = shards[1], shards[2]
    assert shard_names(out1) == shard_names(out2)
    for name in shard_names(out1):
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name


@needs_vocab
def test_edu_type_names_the_shards_edu_fineweb(tmp_path, inputs):
    args = ["--input", inputs[1], "--type", "edu", "--vocab", VOCAB, "--out", tmp_path, "--shard_size", 10]
    proc = fineweb(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert shard_names(tmp_path) == ["edu_fineweb_val_000000.bin", "edu_fineweb_train_000001.bin"]


@needs_vocab
def test_parquet_text_column_gives_the_same_shards_as_jsonl(tmp_path, inputs, shards):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"text": DOCUMENTS, "id": list(range(len(DOCUMENTS)))})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=16)
    args = ["--input", tmp_path / "docs.parquet", inputs[1], "--vocab", VOCAB, "--out", tmp_path / "out",
            "--shard_size", SHARD_SIZE, "--workers", 2]
    proc = fineweb(args, cwd=tmp_path, block=["tqdm"])
    assert proc.returncode == 0, proc.stderr
    out, _ = shards[1]
    for name in shard_names(out):
        assert (tmp_path / "out" / name).read_bytes() == (out / name).read_bytes(), name


@needs_vocab
def test_a_corpus_too_small_for_a_train_shard_is_refused_with_a_shard_size(tmp_path, inputs, expected):
    """Once a val shard alone, and exit 0: -i then matched nothing. Exactly one shard's tokens are refused
    too (shard 0, the val split, was written as soon as it filled)."""
    for size in ("100000000", str(len(expected))):
        proc = fineweb(["--input", *inputs, "--vocab", VOCAB, "--out", tmp_path / "out", "--shard_size",
                        size], cwd=tmp_path)
        assert_one_line_error(proc, f"error: {len(expected):,} tokens fill only shard 0, the val split, at "
                                    f"--shard_size {int(size):,}: there would be no train shard; use a "
                                    f"smaller --shard_size, such as {len(expected) // 10:,} (a tenth of "
                                    f"them)")
        assert not (tmp_path / "out").exists()


@needs_vocab
def test_an_out_that_holds_shards_of_an_earlier_run_is_refused(tmp_path, inputs):
    """Once the new shards replaced the first of the earlier run's and left the others, which -i then matched
    with them. Shards of another prefix (--type edu) are not in the way."""
    args = ["--vocab", VOCAB, "--out", tmp_path, "--shard_size", SHARD_SIZE]
    assert fineweb(["--input", *inputs, *args], cwd=tmp_path).returncode == 0
    before = {name: (tmp_path / name).read_bytes() for name in shard_names(tmp_path)}
    proc = fineweb(["--input", inputs[1], *args], cwd=tmp_path)
    assert_one_line_error(proc, f"error: --out {tmp_path} holds {len(before)} shards of an earlier run "
                                f"(fineweb_train_000001.bin, ...), which the new ones would mix with: delete "
                                f"them ({tmp_path}/fineweb_*.bin), or choose another --out")
    assert {name: (tmp_path / name).read_bytes() for name in shard_names(tmp_path)} == before
    assert fineweb(["--input", inputs[1], "--type", "edu", *args[:-1], 5], cwd=tmp_path).returncode == 0


@needs_vocab
def test_an_input_without_documents_is_one_line_naming_it(tmp_path, inputs):
    """An empty .txt once made a document of EOT alone; an empty .jsonl among other inputs added nothing."""
    txt, jsonl = tmp_path / "empty.txt", tmp_path / "blank.jsonl"
    txt.write_text("")
    jsonl.write_text("\n\n")
    proc = fineweb(["--input", inputs[1], txt, "--vocab", VOCAB, "--out", tmp_path / "out"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {txt}: empty (no text in it): nothing to prepare")
    proc = fineweb(["--input", jsonl, inputs[1], "--vocab", VOCAB, "--out", tmp_path / "out"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {jsonl}: no documents in it: nothing to tokenize")
    assert not (tmp_path / "out").exists()


@needs_vocab
@pytest.mark.parametrize("columns, problem", [
    ({"content": ["a", "b"]}, 'no "text" column (its columns: content)'),
    ({"text": [1, 2, 3]}, 'its "text" column holds int64, not strings'),
    ({"text": [b"bytes", b"are not text"]}, 'its "text" column holds binary, not strings'),
    ({"text": ["a", None, "c"]}, 'row 1 has no "text" (null)'),
])
def test_a_parquet_text_column_that_is_not_strings_is_one_line(tmp_path, columns, problem):
    """Once a TypeError traceback from a tokenizing worker, and a missing column once read "not a parquet
    file"."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table(columns), path)
    proc = fineweb(["--input", path, "--vocab", VOCAB, "--out", tmp_path / "out"], cwd=tmp_path,
                   block=["tqdm"])
    assert_one_line_error(proc, f"error: {path}: {problem}")
    assert not (tmp_path / "out").exists()


def fake_datasets(folder, texts, fail_after=None):
    """A stand-in for the datasets package in `folder` (the scripts' cwd, first on their path): load_dataset
    prints how it was called and streams `texts`, then, with fail_after, loses the connection."""
    (folder / "datasets.py").write_text(f"""
def load_dataset(path, name, split, streaming):
    print(f"load_dataset({{path}}, name={{name}}, split={{split}}, streaming={{streaming}})")
    return rows()

def rows():
    for i, text in enumerate({texts!r}):
        if i == {fail_after!r}:
            raise ConnectionError("Connection reset by peer.\\nRetried 5 times")
        yield {{"id": i, "text": text}}
""")


@needs_vocab
def test_without_input_fineweb_is_streamed_from_the_hub_and_sharded_alike(tmp_path, shards):
    fake_datasets(tmp_path, DOCUMENTS + [TXT])
    args = ["--type", "edu", "--version", "100B", "--vocab", VOCAB, "--out", tmp_path / "out",
            "--shard_size", SHARD_SIZE, "--workers", 2]
    proc = fineweb(args, cwd=tmp_path, block=["tqdm"])
    assert proc.returncode == 0, proc.stderr
    assert ("load_dataset(HuggingFaceFW/fineweb-edu, name=sample-100BT, split=train, streaming=True)"
            in proc.stdout)
    out, _ = shards[1]
    for name in shard_names(out):
        assert (tmp_path / "out" / f"edu_{name}").read_bytes() == (out / name).read_bytes(), name


@needs_vocab
def test_a_stream_that_breaks_is_one_line(tmp_path):
    fake_datasets(tmp_path, DOCUMENTS, fail_after=30)
    proc = fineweb(["--vocab", VOCAB, "--out", tmp_path, "--workers", 2], cwd=tmp_path, block=["tqdm"])
    assert_one_line_error(proc, "error: HuggingFaceFW/fineweb sample-10BT: streaming stopped "
                                "(Connection reset by peer)")


def test_missing_or_unknown_file_is_one_line_before_any_work(tmp_path, inputs):
    missing = tmp_path / "missing.jsonl"
    proc = fineweb(["--input", inputs[1], missing, "--out", tmp_path / "out"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {missing}: no such file")
    assert not (tmp_path / "out").exists()
    csv = tmp_path / "docs.csv"
    csv.write_text("text\nhello\n")
    proc = fineweb(["--input", csv, "--out", tmp_path / "out"], cwd=tmp_path)
    assert_one_line_error(proc, f"error: {csv}: unknown file type: --input takes .txt, .jsonl, .parquet "
                                f"files")


@needs_vocab
@pytest.mark.parametrize("line, problem, workers", [
    ('{"text": "fine"', "JSONDecodeError", 2),               # found while the pool's feeder reads ahead
    ('{"content": "no text field"}', "KeyError: 'text'", 1),
    ('{"text": 42}', "TypeError: text is int", 1),
])
def test_bad_jsonl_line_is_one_line_naming_it(tmp_path, line, problem, workers):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps({"text": "a good line"}) + "\n" + line + "\n")
    proc = fineweb(["--input", jsonl, "--vocab", VOCAB, "--out", tmp_path, "--workers", workers],
                   cwd=tmp_path)
    assert_one_line_error(proc, f'error: {jsonl} line 2: not a JSON object with a "text" string', problem)


@needs_vocab
def test_a_run_that_fails_half_way_removes_its_shards_and_can_run_again(tmp_path, inputs):
    """A bad line found once shards were written: they once stayed, and the next run was refused as one
    into "shards of an earlier run". What the failed run did not write stays: here an edu run's shards."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 5}) + "\n")
    out = tmp_path / "out"
    args = ["--vocab", VOCAB, "--out", out, "--workers", 2, "--shard_size"]
    assert fineweb(["--input", inputs[1], "--type", "edu", *args, 5], cwd=tmp_path).returncode == 0
    earlier = {name: (out / name).read_bytes() for name in os.listdir(out)}
    proc = fineweb(["--input", *inputs, bad, *args, SHARD_SIZE], cwd=tmp_path)
    assert_one_line_error(proc, f'error: {bad} line 2: not a JSON object with a "text" string (TypeError: '
                                f'text is int)\n')
    assert f"writing 100 tokens to {out / 'fineweb_train_000005.bin'}" in proc.stdout
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == earlier
    assert fineweb(["--input", *inputs, *args, SHARD_SIZE], cwd=tmp_path).returncode == 0


def test_without_datasets_fineweb_itself_says_pip_install_data(tmp_path):
    proc = fineweb(["--out", tmp_path], cwd=tmp_path)
    assert proc.stderr == "error: this needs the datasets package: pip install -e \".[data]\"\n"
    assert proc.returncode == 1


def test_parquet_without_pyarrow_says_pip_install_data(tmp_path):
    parquet = tmp_path / "docs.parquet"
    parquet.write_bytes(b"PAR1")
    proc = fineweb(["--input", parquet, "--out", tmp_path], cwd=tmp_path)
    assert proc.stderr == "error: this needs the pyarrow package: pip install -e \".[data]\"\n"
    assert proc.returncode == 1


def test_bad_flags_are_one_line(tmp_path, inputs):
    proc = fineweb(["--input", inputs[1], "--shard_size", 0], cwd=tmp_path)
    assert_one_line_error(proc, "--shard_size 0: a shard holds 1 to 2,147,483,647 tokens")
    proc = fineweb(["--input", inputs[1], "--workers", 0], cwd=tmp_path)
    assert_one_line_error(proc, "--workers 0: give at least 1")
