"""What the data preparation scripts (data/*.py) share: their common flags, reading the source text
from a local file or a download, and printing a user's mistake as one line instead of a traceback."""
import argparse
import io
import os
import sys
import urllib.request

from llm.formats import FormatError
from llm.tokenizer import TokenizerError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PrepError(Exception):
    """A missing or malformed source, or no network: one line naming the file or URL and the problem."""


def arguments(description, url, out, input_env=None):
    """A parser with the flags every script takes: --input (else $input_env, else `url`), --vocab, --out."""
    default = f"${input_env}, else a download" if input_env else "a download"
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--input", default=input_env and os.environ.get(input_env),
                        help=f"the source file (default: {default} of {url})")
    parser.add_argument("--vocab", help="GPT-2's BPE ranks, a gpt2.tiktoken file (default: $GPT2_VOCAB, "
                                        "else tiktoken's download)")
    parser.add_argument("--out", default=os.path.join(REPO, out), help=f"output directory (default: {out})")
    return parser


def read_text(path, url):
    """The UTF-8 text of `path`, or of `url` when path is None."""
    try:
        if path:
            raw = open(path, "rb")
        else:
            print(f"downloading {url}")
            raw = urllib.request.urlopen(url, timeout=60)
        with io.TextIOWrapper(raw, encoding="utf-8") as f:   # text mode, as llm.c reads: "\r\n" is "\n"
            return f.read()
    except FileNotFoundError:
        raise PrepError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise PrepError(f"{path or url}: not UTF-8 text") from None
    except OSError as e:
        if path:
            raise PrepError(f"{path}: cannot read ({e.strerror})") from None
        reason = getattr(e, "reason", e)   # urllib's URLError keeps the cause in .reason
        raise PrepError(f"cannot download {url} ({reason}): pass --input PATH to a local copy") from None


def run(main):
    """Run a script's main(); a user's mistake prints as "error: ..." and exits with status 1."""
    try:
        main()
    except (PrepError, TokenizerError, FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
