"""FineWeb as GPT-2 token shards in llm.c's layout: fineweb_val_000000.bin, then fineweb_train_000001.bin, ...

  python -m data.fineweb                                  stream FineWeb's sample-10BT, write data/fineweb10B/
  python -m data.fineweb --type edu --version 100B        FineWeb-Edu's sample-100BT, data/edu_fineweb100B/
  python -m data.fineweb --input a.jsonl b.txt c.parquet --vocab gpt2.tiktoken --out data/mine    local files

Every document becomes EOT (50256) followed by its tokens, and the documents go back to back, in order,
into shards of --shard_size tokens (10^8 by default, as llm.c); a document can straddle two shards.
Shard 0 is the val split, the rest the train split, as llm.c's dev/data/fineweb.py writes them, so
train_gpt2.py reads them with -i "data/fineweb10B/fineweb_train_*.bin" -j "data/fineweb10B/fineweb_val_*.bin".
What cannot train is refused in one line: a corpus too small for one train shard, an --out that already
holds shards of the prefix, an input without documents or with a "text" that is not a string. The inputs
are read once, as they are tokenized, so a bad one may be found after some shards are written: a run that
fails removes the shards it wrote (never an earlier run's), so that it leaves none and can be run again.

Tokenizing runs on --workers processes; the documents come back in their order, so the shards are
the same whatever the number of workers. Local files: .txt is one document, .jsonl one document per
line (its "text" field), .parquet one per row (its "text" column, read with pyarrow). FineWeb itself is
streamed with the datasets package (pip install -e ".[data]"); local .txt and .jsonl need no extra package.
"""
from contextlib import nullcontext
from itertools import chain
import json
from multiprocessing import Pool
import os
import re

import numpy as np

from data import (REPO, PrepError, arguments, first_line, outputs, quiet_hub_retries, read_text, reading,
                  write_shard)
from llm import formats
from llm.launch import optional, run, worker_signals
from llm.tokenizer import Tokenizer

try:
    from tqdm import tqdm   # comes with datasets; without it, the line for each shard written is the progress
except ImportError:
    tqdm = None

# --type -> (Hugging Face dataset, the prefix of the shards' and the output folder's names)
TYPES = {"classic": ("HuggingFaceFW/fineweb", "fineweb"), "edu": ("HuggingFaceFW/fineweb-edu", "edu_fineweb")}
VERSIONS = ("10B", "100B")       # --version -> the dataset's subset, sample-10BT or sample-100BT
SHARD_SIZE = 10**8
STRING_TYPES = ("string", "large_string", "string_view")   # pyarrow's names for a column of str
CHUNKSIZE = 16                   # documents handed to a worker at a time


# ----------------------------------------------------------------------------------------------
# Documents: the texts, in order, from local files or from FineWeb's stream

def read_txt(path):
    """A .txt file is one document."""
    yield read_text(path, None)


def read_jsonl(path):
    """One document per line: the line's "text" field."""
    with reading(path), open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError(f"text is {type(text).__name__}")
            except (ValueError, KeyError, TypeError) as e:   # json's errors are ValueErrors
                raise PrepError(f'{path} line {n}: not a JSON object with a "text" string '
                                f"({type(e).__name__}: {e})") from None
            yield text


def read_parquet(path):
    """One document per row: the row's "text" column, which must hold strings."""
    pa, pq = optional("pyarrow", "data"), optional("pyarrow.parquet", "data")
    with reading(path):
        try:
            table = pq.ParquetFile(path)
            columns = table.schema_arrow.names
            if "text" not in columns:
                raise PrepError(f'{path}: no "text" column (its columns: {", ".join(columns)})')
            kind = str(table.schema_arrow.field("text").type)
            if kind not in STRING_TYPES:
                raise PrepError(f'{path}: its "text" column holds {kind}, not strings')
            batches = table.iter_batches(columns=["text"])
            for row, text in enumerate(chain.from_iterable(b.column("text").to_pylist() for b in batches)):
                if text is None:
                    raise PrepError(f'{path}: row {row} has no "text" (null)')
                yield text
        except pa.ArrowException as e:   # e.g. ArrowInvalid: "Parquet magic bytes not found"
            raise PrepError(f"{path}: not a parquet file ({e})") from None


READERS = {".txt": read_txt, ".jsonl": read_jsonl, ".parquet": read_parquet}


def documents_of(path):
    """The documents of one local file; a file that holds none (an empty .jsonl or .parquet) is refused."""
    count = 0
    for count, text in enumerate(READERS[os.path.splitext(path)[1].lower()](path), 1):
        yield text
    if count == 0:
        raise PrepError(f"{path}: no documents in it: nothing to tokenize")


def local_documents(paths):
    """The documents of local files, in order; every path is checked first, before any work is done."""
    for path in paths:
        kind = os.path.splitext(path)[1].lower()
        if kind not in READERS:
            raise PrepError(f"{path}: unknown file type: --input takes {', '.join(READERS)} files")
        if not os.path.isfile(path):
            raise PrepError(f"{path}: no such file")
        if kind == ".parquet":
            optional("pyarrow.parquet", "data")
    return chain.from_iterable(documents_of(path) for path in paths)


def fineweb_documents(dataset, version):
    """The texts of FineWeb's sample-<version>T, streamed from Hugging Face with the datasets package."""
    datasets = optional("datasets", "data")
    name = f"sample-{version}T"
    print(f"streaming {dataset} {name}")
    quiet_hub_retries()
    try:
        rows = datasets.load_dataset(dataset, name=name, split="train", streaming=True)
    except Exception as e:   # offline, the errors differ by datasets version and HTTP library
        raise PrepError(f"cannot stream {dataset} {name} ({first_line(e)}): pass --input PATH ... "
                        f"to local .txt, .jsonl or .parquet files") from None
    return texts(rows, f"{dataset} {name}")


def texts(rows, source):
    """Each row's "text"; a connection lost half way is one line."""
    try:
        for row in rows:
            yield row["text"]
    except Exception as e:
        raise PrepError(f"{source}: streaming stopped ({first_line(e)})") from None


# ----------------------------------------------------------------------------------------------
# Tokenizing, on each worker process

tokenizer = None   # this process's GPT-2 BPE, made by load_tokenizer


def load_tokenizer(vocab):
    global tokenizer
    tokenizer = Tokenizer(vocab)


def start_worker(vocab):
    worker_signals()   # a signal is the main process's to report; the pool ends its workers
    load_tokenizer(vocab)


def tokenize(text):
    """One document -> EOT, then its tokens, as uint16 (GPT-2's ids are below 2^16)."""
    return np.array([tokenizer.eot, *tokenizer.encode(text)], dtype=np.uint16)


# ----------------------------------------------------------------------------------------------
# Shards: fixed-size runs of the token stream

class Shards:
    """Fills shards of `size` tokens from the token stream, in order, and writes each one once it is full
    and the stream goes on (the last one may be short), so that a stream too short for a train shard
    writes nothing.

    Shard 0 is the val split and the rest the train split: <prefix>_val_000000.bin,
    <prefix>_train_000001.bin, ... An `out` that already holds shards of the prefix is refused: the new
    shards would replace some of an earlier run's and leave the others, to be trained on with them."""

    def __init__(self, out, prefix, size, written):
        name = re.compile(rf"{re.escape(prefix)}_(?:val|train)_\d{{6}}\.bin")
        earlier = sorted(filter(name.fullmatch, os.listdir(out)))
        if earlier:
            raise PrepError(f"--out {out} holds {len(earlier)} shards of an earlier run ({earlier[0]}"
                            f"{', ...' if len(earlier) > 1 else ''}), which the new ones would mix with: "
                            f"delete them ({os.path.join(out, prefix)}_*.bin), or choose another --out")
        self.out, self.prefix, self.size = out, prefix, size
        self.written = written   # the shards written so far, which a run that fails removes (data.outputs)
        self.buffer = np.empty(size, dtype=np.uint16)
        self.filled = 0      # tokens in buffer
        self.index = 0       # of the shard being filled
        self.bar = None

    def add(self, tokens):
        """Append tokens; a document that does not fit ends the shard and goes on in the next one."""
        while len(tokens):
            if self.filled == self.size:
                self.write()
            n = min(len(tokens), self.size - self.filled)
            self.buffer[self.filled:self.filled + n] = tokens[:n]
            self.filled += n
            tokens = tokens[n:]
            if tqdm:
                self.bar = self.bar or tqdm(total=self.size, unit="tokens", desc=f"shard {self.index}")
                self.bar.update(n)

    def write(self):
        """Write the shard being filled and start the next."""
        if self.bar:
            self.bar.close()
            self.bar = None
        split = "val" if self.index == 0 else "train"
        path = os.path.join(self.out, f"{self.prefix}_{split}_{self.index:06d}.bin")
        write_shard(path, self.buffer[:self.filled])
        self.written.append(path)
        self.index += 1
        self.filled = 0


def main(argv):
    parser = arguments(__doc__.splitlines()[0], "HuggingFaceFW/fineweb's sample-10BT; see --type, --version",
                       None, input_help="local .txt, .jsonl or .parquet files", nargs="+",
                       out_help="data/fineweb10B, data/edu_fineweb10B for --type edu, 100B for "
                                "--version 100B")
    parser.add_argument("--type", choices=TYPES, default="classic",
                        help="FineWeb or FineWeb-Edu (default: classic)")
    parser.add_argument("--version", choices=VERSIONS, default="10B", help="the sample's size (default: 10B)")
    parser.add_argument("--shard_size", type=int, default=SHARD_SIZE, help="tokens per shard (default: 10^8)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(),
                        help="tokenizing processes (default: the number of CPUs)")
    args = parser.parse_args(argv)
    if not 1 <= args.shard_size <= formats.MAX_SHARD_TOKENS:
        raise PrepError(f"--shard_size {args.shard_size}: a shard holds 1 to {formats.MAX_SHARD_TOKENS:,} "
                        f"tokens")
    if args.workers < 1:
        raise PrepError(f"--workers {args.workers}: give at least 1")
    dataset, prefix = TYPES[args.type]
    out = args.out or os.path.join(REPO, "data", f"{prefix}{args.version}")
    with outputs(out) as written:
        if args.input:
            documents = local_documents(args.input)
        else:
            optional("datasets", "data")
        load_tokenizer(args.vocab)   # here first, so a bad --vocab is one line rather than failing workers
        shards = Shards(out, prefix, args.shard_size, written)
        # the workers start before the stream opens: the stream's threads are not forked into them
        with Pool(args.workers, start_worker, (args.vocab,)) if args.workers > 1 else nullcontext() as pool:
            if not args.input:
                documents = fineweb_documents(dataset, args.version)
            # imap returns the results in the documents' order, however the workers interleave
            tokenized = pool.imap(tokenize, documents, CHUNKSIZE) if pool else map(tokenize, documents)
            ndocs = ntokens = 0
            try:
                for tokens in tokenized:
                    shards.add(tokens)
                    ndocs, ntokens = ndocs + 1, ntokens + len(tokens)
            finally:   # a stream that breaks: its error line goes below the progress bar, not into it
                if shards.bar:
                    shards.bar.close()
        if ndocs == 0:   # (a local file without documents is refused as it is read)
            raise PrepError(f"no documents in {dataset}")
        if shards.index == 0:   # all of them in shard 0, the val split, which is not written yet
            raise PrepError(f"{ntokens:,} tokens fill only shard 0, the val split, at --shard_size "
                            f"{args.shard_size:,}: there would be no train shard; use a smaller "
                            f"--shard_size, such as {max(ntokens // 10, 1):,} (a tenth of them)")
        shards.write()
    print(f"tokenized {ndocs:,} documents: {ntokens:,} tokens in {shards.index} shards in {out}")


if __name__ == "__main__":
    run(main)
