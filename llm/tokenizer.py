"""GPT-2's byte-pair encoding, on tiktoken, and a decoder that needs only llm.c's gpt2_tokenizer.bin.

Tokenizer encodes and decodes with tiktoken; the data scripts use it. Its merge ranks come from a local
`gpt2.tiktoken` file when one is named (the --vocab flag or the GPT2_VOCAB environment variable), else
tiktoken downloads them. TokenizerFile decodes from the byte strings a tokenizer file holds, as llm.c's
training loop does when it prints samples.
"""
import os

import tiktoken
import tiktoken.load

from llm import formats
from llm.config import GPT2_EOT
from llm.launch import UserError

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs and other symbols (each with at most
# one leading space), then whitespace. BPE merges happen only inside these pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
VOCAB_ENV = "GPT2_VOCAB"
NO_VOCAB_HINT = f"pass --vocab PATH to a gpt2.tiktoken file or set {VOCAB_ENV}"


class TokenizerError(UserError):
    """GPT-2's vocabulary could not be loaded; the one-line message says what to do."""


def get_encoding(vocab_path=None):
    """GPT-2's tiktoken Encoding: from vocab_path or $GPT2_VOCAB when given, else tiktoken's download."""
    vocab_path = vocab_path or os.environ.get(VOCAB_ENV)
    if not vocab_path:
        try:
            return tiktoken.get_encoding("gpt2")
        except OSError:   # requests' connection errors are OSErrors
            raise TokenizerError(f"cannot download GPT-2's BPE ranks (offline?): {NO_VOCAB_HINT}") from None
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(vocab_path)
    except FileNotFoundError:
        raise TokenizerError(f"{vocab_path}: no such file: {NO_VOCAB_HINT}") from None
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{vocab_path}: not a tiktoken ranks file ({e})") from None
    if len(ranks) != GPT2_EOT or max(ranks.values()) != GPT2_EOT - 1:
        raise TokenizerError(f"{vocab_path}: {len(ranks)} ranks, but GPT-2 has {GPT2_EOT} "
                             f"(ids 0..{GPT2_EOT - 1})")
    return tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: GPT2_EOT},
                             explicit_n_vocab=GPT2_EOT + 1)


class Tokenizer:
    """GPT-2 BPE: text to token ids and back; eot (<|endoftext|>, 50256) separates documents."""

    def __init__(self, vocab_path=None):
        self.enc = get_encoding(vocab_path)
        self.eot = self.enc.eot_token

    def encode(self, text):
        """Ordinary encoding: "<|endoftext|>" in the text is plain text, never the EOT token."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts):
        """encode() of each text, on several threads."""
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids):
        return self.enc.decode(ids)

    def token_bytes(self):
        """The byte string of every token id 0..50256 (a token may be part of a UTF-8 character)."""
        return [self.enc.decode_single_token_bytes(i) for i in range(self.enc.n_vocab)]

    def write_tokenizer_file(self, path):
        """Write llm.c's gpt2_tokenizer.bin (version 2), which TokenizerFile reads."""
        formats.write_tokenizer(path, self.token_bytes(), self.eot)


class TokenizerFile:
    """Decoding from an llm.c tokenizer file alone: join the tokens' bytes, then decode UTF-8.

    A token can hold part of a character, so a lone piece decodes as U+FFFD, as tiktoken's decode does."""

    def __init__(self, path, expected_vocab=None):
        self.token_bytes, self.eot = formats.read_tokenizer(path, expected_vocab)

    def decode(self, ids):
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")
