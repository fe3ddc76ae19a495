"""python -m llm.export: a checkpoint as a Hugging Face folder that comes back bit for bit, and tokenizer
files that encode as tiktoken does.

The model is a tiny GPT-2 (L=2, C=64, NH=4, maxT=32) with GPT-2's vocabulary, its parameters drawn at random
(llm.c's padding rows of wte 0, as training keeps them). data/gpt2.py reads the folder back; it is checked
against a forward on Hugging Face's tensors in test_gpt2_weights.py, so the round trip checks the export's
names and layout too. The tokenizer files are read by a byte-level BPE written here as GPT-2's encoder.py
and transformers' GPT2Tokenizer run it. Loading the folder in transformers is bench/hf_check.py's part."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import regex

from conftest import env
from llm import formats
from llm.config import GPT2Config
from llm.layout import ParamViews
from llm.tokenizer import Tokenizer
from prep_scripts import VOCAB, needs_vocab, run_script

safetensors = pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

CONFIG = GPT2Config(max_seq_len=32, num_layers=2, num_heads=4, channels=64)   # V = 50257, Vp = 50304
V = CONFIG.vocab_size
FILES = ["config.json", "generation_config.json", "merges.txt", "model.safetensors", "tokenizer_config.json",
         "vocab.json"]
TEXTS = [
    "Hello world! This is GPT-2's tokenizer, exported.",                   # ASCII
    "naïve café, Ünïcödé, 日本語のテキスト, Ελληνικά, emoji 🙂👍🏽 and ﬁ ligatures",   # multi-byte UTF-8
    "a  b   c\t\td\n\n\nend   \n  \r\n indented\u00a0nbsp\u3000ideographic    ",   # runs of whitespace
    "3.14159 + 1234567890 = 2024-12-03, 0x7FFF, ٣٤٥ (Arabic-Indic), ½ ²",  # numbers
    "I'm sure you're right: we've, they'll, she'd, it's; DON'T, Ain't, 'tis, o'clock",   # contractions
    "<|endoftext|> is ordinary text here, as in tiktoken's encode_ordinary",
]


def random_params(seed=0):
    """Every parameter from N(0, 0.1), but wte's padding rows: 0, as llm.c's init and training keep them."""
    params = (0.1 * np.random.default_rng(seed).standard_normal(CONFIG.num_parameters)).astype(np.float32)
    params[V * CONFIG.channels:CONFIG.padded_vocab_size * CONFIG.channels] = 0   # wte is first in the buffer
    return params


def export(cwd, *args):
    """python -m llm.export in `cwd`, as a user runs it; the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, "-m", "llm.export", *map(str, args)], cwd=cwd,
                          env=env() | {"PYTHONDONTWRITEBYTECODE": "1"},   # no __pycache__ for a fake hub
                          capture_output=True, text=True, timeout=120)


def exported(cwd, *args):
    proc = export(cwd, *args, "--vocab", VOCAB)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def read_back(tmp_path, folder):
    """data/gpt2.py --input folder: the llm.c model files it writes, (fp32 path, bf16 path)."""
    proc = run_script("gpt2", ["--input", folder, "--vocab", VOCAB, "--out", tmp_path / "back"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "back" / "gpt2_d2c64h4.bin", tmp_path / "back" / "gpt2_d2c64h4_bf16.bin"


def tensors_of(path):
    """model.safetensors' tensors as {name: (dtype, shape, raw bytes)}, bf16 included (which NumPy lacks)."""
    return {name: (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
            for name, t in safetensors.deserialize(path.read_bytes())}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model.bin (v3, fp32), and run/, a run's directory whose newest complete checkpoint (step 20) is v5
    (bf16): model.bin's parameters rounded to bf16."""
    folder = tmp_path_factory.mktemp("export")
    formats.write_model(folder / "model.bin", CONFIG, random_params())
    run = folder / "run"
    run.mkdir()
    for step, seed, done in ((10, 1, True), (20, 0, True), (30, 2, False)):   # 30: no DONE, being written
        formats.write_model(run / f"model_{step:08d}.bin", CONFIG, random_params(seed),
                            formats.MODEL_VERSION_BF16)
        if done:
            (run / f"DONE_{step:08d}").touch()
    return folder


@pytest.fixture(scope="module")
def fp32_export(models):
    stdout = exported(models, "-e", "model.bin", "--out", "hf32")
    return models / "hf32", stdout


@pytest.fixture(scope="module")
def bf16_export(models):
    stdout = exported(models, "-e", "run", "--out", "hf16")
    return models / "hf16", stdout


@needs_vocab
def test_data_gpt2_reads_the_export_back_bit_for_bit(tmp_path, models, fp32_export):
    folder, stdout = fp32_export
    assert sorted(os.listdir(folder)) == FILES
    assert "writing hf32/model.safetensors: 3,318,592 parameters in fp32 (wte's 50,257 rows" in stdout
    assert CONFIG.num_parameters - (50304 - V) * 64 == 3_318_592        # llm.c's padding rows stay behind
    fp32, bf16 = read_back(tmp_path, folder)
    assert fp32.read_bytes() == (models / "model.bin").read_bytes()                  # header and payload
    assert bf16.read_bytes() == (models / "run" / "model_00000020.bin").read_bytes()   # rounded alike


@needs_vocab
def test_safetensors_holds_hugging_faces_names_in_conv1d_layout(models, fp32_export):
    t = tensors_of(fp32_export[0] / "model.safetensors")
    assert len(t) == 4 + 2 * 12                                          # no lm_head, no mask buffers
    assert t["transformer.wte.weight"][:2] == ("F32", (V, 64))
    assert t["transformer.h.1.attn.c_attn.weight"][:2] == ("F32", (64, 192))   # (in, out): Conv1D
    assert t["transformer.h.0.mlp.c_proj.weight"][:2] == ("F32", (256, 64))
    p = ParamViews(formats.read_model(models / "model.bin")[1], CONFIG)
    assert t["transformer.h.1.attn.c_attn.weight"][2] == np.ascontiguousarray(p.qkvw[1].T).tobytes()
    assert t["transformer.wte.weight"][2] == p.wte[:V].tobytes()
    raw = (fp32_export[0] / "model.safetensors").read_bytes()   # the header's size in 8 bytes, then its JSON
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"format": "pt"}                    # without it transformers refuses


@needs_vocab
def test_bf16_export_of_a_run_is_its_newest_complete_checkpoint_bit_for_bit(models, fp32_export, bf16_export):
    """Step 20's v5 file holds model.bin rounded to bf16, so its export is the fp32 export's tensors rounded,
    bit for bit; and data/gpt2.py writes the same v5 file from the fp32 export (the test above)."""
    folder, stdout = bf16_export
    assert stdout.startswith(f"{os.path.join('run', 'model_00000020.bin')} (version 5, bf16)")   # not step 30
    bf16, fp32 = tensors_of(folder / "model.safetensors"), tensors_of(fp32_export[0] / "model.safetensors")
    assert bf16.keys() == fp32.keys()
    for name, (dtype, shape, bits) in bf16.items():
        assert (dtype, shape) == ("BF16", fp32[name][1]), name
        rounded = formats.float32_to_bf16_bits(np.frombuffer(fp32[name][2], "<f4"))
        assert bits == rounded.tobytes(), name


@needs_vocab
def test_config_json_describes_the_model(fp32_export, bf16_export):
    config = json.loads((fp32_export[0] / "config.json").read_text())
    assert {k: config[k] for k in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")} == \
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32, "vocab_size": 50257}
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert config["tie_word_embeddings"] is True and config["activation_function"] == "gelu_new"
    assert config["torch_dtype"] == "float32"
    assert json.loads((bf16_export[0] / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((fp32_export[0] / "generation_config.json").read_text()) == \
        {"bos_token_id": 50256, "eos_token_id": 50256}
    tokenizer_config = json.loads((fp32_export[0] / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "GPT2Tokenizer"
    assert tokenizer_config["model_max_length"] == 32
    assert tokenizer_config["eos_token"] == "<|endoftext|>"


# GPT-2's tokenizer as its encoder.py (and transformers' GPT2Tokenizer) runs it, from vocab.json and
# merges.txt alone. The split is encoder.py's pattern, tiktoken's written otherwise.
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def gpt2_bytes_to_unicode():
    """encoder.py's table: printable bytes are themselves, the others chr(256), chr(257), ... in order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class FileTokenizer:
    def __init__(self, folder):
        self.vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        lines = (folder / "merges.txt").read_text(encoding="utf-8").split("\n")
        assert lines[0].startswith("#version") and lines[-1] == ""
        self.merges = {tuple(line.split(" ")): i for i, line in enumerate(lines[1:-1])}
        self.chars = gpt2_bytes_to_unicode()

    def word(self, word):
        """Greedy BPE: merge the adjacent pair listed first in merges.txt, until no pair is listed."""
        parts = list(word)
        while True:
            pairs = [(self.merges.get(pair, math.inf), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs, default=(math.inf, 0))
            if rank == math.inf:
                return [self.vocab[part] for part in parts]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]

    def encode(self, text):
        return [i for piece in GPT2_SPLIT.findall(text)
                for i in self.word("".join(self.chars[b] for b in piece.encode("utf-8")))]


@needs_vocab
def test_tokenizer_files_encode_as_tiktoken(fp32_export):
    files, tiktoken = FileTokenizer(fp32_export[0]), Tokenizer(VOCAB)
    for text in TEXTS:
        assert files.encode(text) == tiktoken.encode(text), text
    assert len(files.merges) == 50_000 and len(files.vocab) == 50_257
    assert files.vocab["Ġthe"] == 262 and files.vocab["<|endoftext|>"] == 50256 and files.vocab["!"] == 0
    assert list(files.merges)[:3] == [("Ġ", "t"), ("Ġ", "a"), ("h", "e")]    # GPT-2's merges.txt begins so


@needs_vocab
def test_every_token_is_reached_by_the_merges(fp32_export):
    """Each of the 50,256 ranked tokens, its bytes alone run through the files' BPE, comes out as itself."""
    files = FileTokenizer(fp32_export[0])
    for token, i in files.vocab.items():
        if i != 50256:
            assert files.word(token) == [i], token




def fake_hub(folder, problem=None):
    """huggingface_hub in `folder` (first on the exporter's path): HfApi prints its calls, or raises
    `problem`."""
    (folder / "huggingface_hub" / "utils").mkdir(parents=True)
    (folder / "huggingface_hub" / "utils" / "__init__.py").write_text("")
    (folder / "huggingface_hub" / "utils" / "logging.py").write_text("def set_verbosity_error():\n    pass\n")
    code = f"""
class HfApi:
    def create_repo(self, repo_id, exist_ok=False):
        print(f"create_repo({{repo_id}}, exist_ok={{exist_ok}})")
        if {problem!r}:
            raise OSError({problem!r})

    def upload_folder(self, folder_path, repo_id, commit_message):
        print(f"upload_folder({{folder_path}}, {{repo_id}})")
"""
    (folder / "huggingface_hub" / "__init__.py").write_text(code)


@needs_vocab
def test_an_earlier_export_is_replaced_and_pushed(tmp_path, models, fp32_export):
    shutil.copytree(fp32_export[0], tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors.1234.tmp").write_bytes(b"what a killed export leaves")
    fake_hub(tmp_path)
    stdout = exported(tmp_path, "-e", models / "run", "--out", "hf", "--push", "user/tiny-gpt2")
    assert "replacing the earlier export's config.json, generation_config.json, merges.txt" in stdout
    assert sorted(os.listdir(tmp_path / "hf")) == FILES
    assert tensors_of(tmp_path / "hf" / "model.safetensors")["transformer.wpe.weight"][0] == "BF16"
    assert stdout.splitlines()[-3:] == ["uploading hf to https://huggingface.co/user/tiny-gpt2",
                                        "create_repo(user/tiny-gpt2, exist_ok=True)",
                                        "upload_folder(hf, user/tiny-gpt2)"]


@needs_vocab
def test_push_offline_is_one_line_and_keeps_the_export(tmp_path, models):
    fake_hub(tmp_path, "Name or service not known\nRetried 5 times")
    proc = export(tmp_path, "-e", models / "model.bin", "--out", "hf", "--push", "user/tiny-gpt2",
                  "--vocab", VOCAB)
    assert proc.returncode == 1 and proc.stderr == (
        "error: cannot upload to user/tiny-gpt2 (Name or service not known): the export in hf is complete; "
        "upload it later with: hf upload user/tiny-gpt2 hf\n")
    assert sorted(os.listdir(tmp_path / "hf")) == FILES


@pytest.mark.parametrize("args, message", [
    (["-e", "missing.bin"], "missing.bin: no such file"),
    (["-e", "tokenizer.bin"], "tokenizer.bin: bad magic 20240328 (expected 20240326: an llm.c model "
                              "checkpoint); this is an llm.c tokenizer file"),
    (["-e", "."], ".: a directory without a complete checkpoint (no DONE_%08d file)"),
    (["-e", "small_vocab.bin"], "small_vocab.bin: vocab_size 96, but the tokenizer files are GPT-2's, "
                                "with 50257"),
    (["--out", "a_file"], "--out a_file: exists and is not a folder: name a folder"),
    (["--out", "a_file/hf"], "--out a_file/hf: a part of the path is a file, not a folder"),
    (["--out", ""], "--out is empty: name a folder"),
    (["--out", "other_model"], "--out other_model: holds other files (README.md, tokenizer.json), which "
                               "would be loaded with the model: name a new or empty folder"),
    (["--vocab", "missing.tiktoken"], "missing.tiktoken: no such file: pass --vocab PATH"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--push", "no-user"], "--push no-user: name the Hub repo as USER/REPO"),
    (["--push", "user/repo", "--missing", "huggingface_hub"],
     "this needs the huggingface_hub package: pip install -e \".[weights]\""),
    (["--missing", "safetensors"], "this needs the safetensors package: pip install -e \".[weights]\""),
    (["--dtype", "bf16", "--missing", "ml_dtypes"],
     "this needs the ml_dtypes package: pip install -e \".[weights]\""),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    formats.write_model(tmp_path / "model.bin", CONFIG, random_params())
    small = GPT2Config(max_seq_len=8, vocab_size=96, padded_vocab_size=128, num_layers=1, num_heads=2,
                       channels=16)
    formats.write_model(tmp_path / "small_vocab.bin", small, np.full(small.num_parameters, 0.02, np.float32))
    formats.write_tokenizer(tmp_path / "tokenizer.bin", [b"a", b"b"], 1)
    (tmp_path / "a_file").write_text("not a folder\n")
    (tmp_path / "other_model").mkdir()
    for name in ("README.md", "tokenizer.json", "config.json"):
        (tmp_path / "other_model" / name).write_text("{}\n")
    # a module in the exporter's folder that fails to import, as a package not installed
    if "--missing" in args:
        package = args[-1]
        (tmp_path / f"{package}.py").write_text(f"raise ImportError('No module named {package}')\n")
        args = args[:-2]
    options = dict(zip(["-e", "--out", "--vocab"], ["model.bin", "hf", VOCAB]))
    options.update(zip(args[::2], args[1::2]))
    before = sorted(os.walk(tmp_path))
    proc = export(tmp_path, *[x for option in options.items() for x in option])
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert sorted(os.walk(tmp_path)) == before                          # nothing written, nothing removed
