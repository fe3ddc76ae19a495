"""What the data preparation scripts share: their common flags, checking the places they write (and emptying
them of what a run that fails wrote), reading the source text from a local file or a download, and writing
shards. Each script runs as a module from the repository's root (python -m data.tinyshakespeare) through
llm.launch.run, which prints a user's mistake as one line."""
from contextlib import contextmanager, suppress
import io
import os
import urllib.request

from llm import formats
from llm.launch import (Parser, UserError, existing_folder, file_problem, from_environment, output_dir,
                        output_file)
from llm.tokenizer import VOCAB_ENV, ranks_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUT_HINT = "pass --input PATH to a local copy"   # what a failed download says to do


class PrepError(UserError):
    """A missing or malformed source, or no network: one line naming the file or URL and the problem."""


class ScriptParser(Parser):
    """The scripts' Parser: --input left out stands for the path in its environment variable, and the ranks
    file (--vocab, else $GPT2_VOCAB) is the tokenizer's; each is checked as the flags are, before any
    download or long read, and a path from a variable is named with it (llm.launch.from_environment), since
    the user may have set it long ago. --vocab stays as given: the tokenizer reads $GPT2_VOCAB itself."""

    def __init__(self, input_env, **kwargs):
        super().__init__(**kwargs)
        self.input_env = input_env

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.input is None and self.input_env:
            parsed.input = env_path(self.input_env, "--input")
        ranks_file(parsed.vocab)
        return parsed


def env_path(variable, flag):
    """The path in $variable, None when it is unset or empty; a PrepError where it names no readable file."""
    path = os.environ.get(variable) or None
    if path and (problem := file_problem(path)):
        raise PrepError(from_environment(path, variable, flag, problem))
    return path


def arguments(description, url, out, input_env=None, input_help="the source file", nargs=None, out_help=None):
    """A parser with the flags every script takes: --input (else $input_env, else `url`), --vocab (else
    $GPT2_VOCAB, else tiktoken's download), --out.

    `out` is the default output directory relative to the repo ("" for the repo root), or None when the
    script works it out from other flags after parsing (out_help then says how). nargs="+" lets --input
    take several paths."""
    default = f"${input_env}, else a download" if input_env else "a download"
    parser = ScriptParser(input_env, description=description)
    parser.add_argument("--input", nargs=nargs, help=f"{input_help} (default: {default} of {url})")
    parser.add_argument("--vocab", help=f"GPT-2's BPE ranks, a gpt2.tiktoken file (default: ${VOCAB_ENV}, "
                                        "else tiktoken's download)")
    parser.add_argument("--out", default=None if out is None else os.path.join(REPO, out),
                        help=f"output directory (default: {out_help or out or 'the repo root'})")
    return parser


@contextmanager
def outputs(out, *files):
    """The places a script writes, the --out folder `out` and each (flag, path) of `files`, checked with
    output_dir and output_file before any work: one that cannot be written is one line at once, not an
    error naming a temporary file once the work is done. Yields a list, to which the script adds each file
    once it is written, where more work follows. A run that fails (a bad input found half way, a full disk,
    Ctrl-C) removes those of them that were not there before it, and the folders made here, so that it
    leaves nothing behind and can be run again; a file that was there before stays (with what this run
    wrote into it, if it got that far: the run was asked to replace it)."""
    output_dir(out)
    for flag, path in files:
        output_file(path, flag)
    folders = [os.path.abspath(out), *(os.path.dirname(os.path.abspath(path)) for _, path in files)]
    made = [(folder, existing_folder(folder)) for folder in folders]   # makedirs makes those below
    there = {os.path.join(folder, name) for folder in folders if os.path.isdir(folder)
             for name in os.listdir(folder)}
    written = []
    try:
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
        yield written
    except BaseException:
        for path in written:
            if os.path.abspath(path) not in there:
                with suppress(OSError):   # the error that stopped the run is the one to report
                    os.remove(path)
        for folder, top in made:
            remove_made(folder, top)
        raise


def remove_made(folder, existing):
    """Remove `folder` and its parents below `existing`, the folder that was there before, while they are
    empty."""
    while folder != existing:
        try:
            os.rmdir(folder)
        except FileNotFoundError:   # makedirs stopped above it
            pass
        except OSError:   # not empty: it holds what this run did not write
            return
        folder = os.path.dirname(folder)


@contextmanager
def reading(path, url=None, offline_hint=INPUT_HINT):
    """Turn the errors of reading `path` (or, when path is None, downloading `url`) into one-line PrepErrors;
    a failed download ends with `offline_hint`."""
    try:
        yield
    except FileNotFoundError:
        raise PrepError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise PrepError(f"{path or url}: not UTF-8 text") from None
    except OSError as e:
        if path:
            raise PrepError(f"{path}: cannot read ({e.strerror or e})") from None
        reason = getattr(e, "reason", e)   # urllib's URLError keeps the cause in .reason
        raise PrepError(f"cannot download {url} ({reason}): {offline_hint}") from None


def read_text(path, url, offline_hint=INPUT_HINT):
    """The UTF-8 text of `path`, or of `url` when path is None (`offline_hint` as reading()); PrepError for
    one that holds no text, which no script can prepare anything from."""
    with reading(path, url, offline_hint):
        if path:
            raw = open(path, "rb")
        else:
            print(f"downloading {url}")
            raw = urllib.request.urlopen(url, timeout=60)
        with io.TextIOWrapper(raw, encoding="utf-8") as f:   # text mode, as llm.c reads: "\r\n" is "\n"
            text = f.read()
    if not text.strip():
        raise PrepError(f"{path or url}: empty (no text in it): nothing to prepare")
    return text


def first_line(e):
    """An exception's message cut to its first sentence on its first line (network libraries' messages run
    on)."""
    message = str(e).strip()
    return message.splitlines()[0].split(". ")[0].rstrip(".") if message else type(e).__name__


def quiet_hub_retries():
    """Hugging Face's hub client logs a warning for each of its retries (five, over about 25 s without a
    network); the caller says the failure once, in its own line."""
    try:
        from huggingface_hub.utils import logging as hub_logging   # (loading it sets the level we change)
    except ImportError:   # a package that streams without it
        return
    hub_logging.set_verbosity_error()


def write_shard(path, tokens):
    """formats.write_shard, with llm.c's line saying what is written."""
    size = formats.HEADER_BYTES + 2 * len(tokens)
    print(f"writing {len(tokens):,} tokens to {path} ({size:,} bytes) in the gpt-2 format")
    formats.write_shard(path, tokens)
