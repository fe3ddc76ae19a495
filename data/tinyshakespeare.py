"""Tiny Shakespeare as GPT-2 token shards, byte for byte what llm.c's dev/data/tinyshakespeare.py writes.

  python -m data.tinyshakespeare                                             download corpus and ranks
  python -m data.tinyshakespeare --input tinyshakespeare.txt --vocab gpt2.tiktoken    offline

Each section of the text between blank lines is a document: EOT, then the section's tokens. The first
32,768 tokens are the val split, the other 305,260 the train split. It also writes gpt2_tokenizer.bin,
from which train_gpt2.py decodes the samples it prints.
"""
import os

from data import REPO, PrepError, arguments, outputs, read_text, write_shard
from llm.launch import run
from llm.tokenizer import VOCAB_ENV, Tokenizer, ranks_file

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
INPUT_ENV = "TINYSHAKESPEARE"   # the corpus's local copy, as --input
# offline, both downloads would fail: one message names both local files, or the one still missing
OFFLINE_HINT = (f"offline? set {INPUT_ENV}=path/to/input.txt and {VOCAB_ENV}=path/to/gpt2.tiktoken "
                "(make passes both on), or pass --input and --vocab")
OFFLINE_INPUT_HINT = f"offline? set {INPUT_ENV}=path/to/input.txt (make passes it on), or pass --input"
VAL_TOKENS = 32768
PROGRESS_LINES = 4


def tokenize(text, tokenizer):
    """The corpus as one token list: EOT + tokens of each "\\n\\n"-separated section.

    llm.c meant to drop each "\\n\\n" but put EOT after it instead, so every section but the last keeps
    its "\\n\\n"; we keep that too, for identical files."""
    sections = text.split("\n\n")
    documents = [s + "\n\n" for s in sections[:-1]] + sections[-1:]
    tokens = []
    chunk = -(-len(documents) // PROGRESS_LINES)
    for start in range(0, len(documents), chunk):
        for document in tokenizer.encode_batch(documents[start:start + chunk]):
            tokens.append(tokenizer.eot)
            tokens.extend(document)
        done = min(start + chunk, len(documents))
        print(f"tokenized {done:,}/{len(documents):,} sections ({len(tokens):,} tokens)")
    return tokens


def main(argv):
    parser = arguments(__doc__.splitlines()[0], URL, os.path.join("data", "tinyshakespeare"), INPUT_ENV)
    parser.add_argument("--tokenizer", default=os.path.join(REPO, "gpt2_tokenizer.bin"),
                        help="where to write llm.c's tokenizer file (default: gpt2_tokenizer.bin)")
    args = parser.parse_args(argv)
    with outputs(args.out, ("--tokenizer", args.tokenizer)) as written:
        offline_hint = OFFLINE_INPUT_HINT if ranks_file(args.vocab) else OFFLINE_HINT   # the ranks are here
        text = read_text(args.input, URL, offline_hint=offline_hint)
        tokenizer = Tokenizer(args.vocab)
        tokens = tokenize(text, tokenizer)
        if len(tokens) <= VAL_TOKENS:   # the val split would take them all
            raise PrepError(f"{args.input or URL}: {len(tokens):,} tokens, and the first {VAL_TOKENS:,} are "
                            f"the val split: nothing is left to train on (tiny Shakespeare makes 338,028)")
        for split, part in (("val", tokens[:VAL_TOKENS]), ("train", tokens[VAL_TOKENS:])):
            path = os.path.join(args.out, f"tiny_shakespeare_{split}.bin")
            write_shard(path, part)
            written.append(path)
        print(f"writing the bytes of {tokenizer.enc.n_vocab:,} tokens to {args.tokenizer}")
        tokenizer.write_tokenizer_file(args.tokenizer)


if __name__ == "__main__":
    run(main)
