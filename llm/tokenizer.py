"""GPT-2's byte-pair encoding, on tiktoken, and a decoder that needs only llm.c's gpt2_tokenizer.bin.

Tokenizer encodes and decodes with tiktoken; the data scripts use it. Its merge ranks come from a local
`gpt2.tiktoken` file when one is named (the --vocab flag or the GPT2_VOCAB environment variable), else
tiktoken downloads them. TokenizerFile decodes from the byte strings a tokenizer file holds, as llm.c's
training loop does when it prints samples. byte_to_unicode and recover_merges give GPT-2's original files
(vocab.json, merges.txt, which Hugging Face's tokenizer reads) from the same ranks: python -m llm.export.
"""
import os

import tiktoken
import tiktoken.load

from llm import formats
from llm.config import GPT2_EOT
from llm.launch import UserError, file_problem, from_environment

# GPT-2's pre-tokenizer: contractions, letter runs, digit runs and other symbols (each with at most
# one leading space), then whitespace. BPE merges happen only inside these pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
ENDOFTEXT = "<|endoftext|>"
VOCAB_ENV = "GPT2_VOCAB"
NO_VOCAB_HINT = f"pass --vocab PATH to a gpt2.tiktoken file or set {VOCAB_ENV}"


class TokenizerError(UserError):
    """GPT-2's vocabulary could not be loaded; the one-line message says what to do."""


def ranks_file(vocab_path=None):
    """The GPT-2 ranks file that get_encoding reads: vocab_path (--vocab), else $GPT2_VOCAB, else None for
    tiktoken's download. A TokenizerError, one line, where the one named is missing or a folder: a command
    can call this first, before a long download or read, and find that out at once."""
    path = vocab_path or os.environ.get(VOCAB_ENV)
    if path and (problem := file_problem(path)):
        raise _bad_ranks(path, vocab_path, problem)
    return path


def _bad_ranks(path, vocab_path, problem):
    """The error for the ranks file `path`, named by --vocab (vocab_path) or else by $GPT2_VOCAB."""
    return TokenizerError(f"{path}: {problem}: {NO_VOCAB_HINT}" if vocab_path else
                          from_environment(path, VOCAB_ENV, "--vocab", problem))


def get_encoding(vocab_path=None):
    """GPT-2's tiktoken Encoding: from vocab_path or $GPT2_VOCAB when given, else tiktoken's download."""
    path = ranks_file(vocab_path)
    if not path:
        try:
            return tiktoken.get_encoding("gpt2")
        except OSError:   # requests' connection errors are OSErrors
            raise TokenizerError(f"cannot download GPT-2's BPE ranks (offline?): {NO_VOCAB_HINT}") from None

    def bad(problem):
        return _bad_ranks(path, vocab_path, problem)
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(path)
    except OSError as e:
        raise bad(f"cannot read ({e.strerror or e})") from None
    except ValueError:   # its message quotes the line it could not parse, which can be kilobytes of bytes
        raise bad(f"not a tiktoken ranks file{formats.what_it_is(path)}") from None
    if len(ranks) != GPT2_EOT or max(ranks.values()) != GPT2_EOT - 1:
        raise bad(f"{len(ranks)} ranks, but GPT-2 has {GPT2_EOT} (ids 0..{GPT2_EOT - 1})")
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


# ----------------------------------------------------------------------------------------------
# GPT-2's original BPE files, vocab.json and merges.txt, from tiktoken's ranks

def byte_to_unicode():
    """GPT-2's byte -> character table, in which vocab.json and merges.txt spell a token's bytes as text.

    The 188 printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the 68 others (control
    characters, the space, 0x7F..0xA0, the soft hyphen 0xAD) become chr(256), chr(257), ... in byte order,
    so that a space is "Ġ" (chr(256 + 32)) and a newline "Ċ" (chr(256 + 10))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def bpe(token, ranks, max_rank):
    """`token`'s bytes merged by byte-pair encoding with the merges of rank below max_rank: from single
    bytes, join the adjacent pair whose bytes together have the lowest rank, until no pair has a rank below
    max_rank."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        pair_ranks = [ranks.get(a + b, max_rank) for a, b in zip(parts, parts[1:])]
        rank = min(pair_ranks)
        if rank >= max_rank:
            break
        i = pair_ranks.index(rank)   # the first pair of that rank, as tiktoken merges
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def recover_merges(ranked):
    """GPT-2's merges, in order, from its ranked tokens (`ranked[r]` is the bytes of the token of rank r).

    tiktoken ranks tokens, merges.txt lists pairs: the token of rank r was made by the merge of the two parts
    that BPE with the merges below r leaves of it. Every token longer than a byte is one merge, so GPT-2's
    50,256 ranked tokens give its 256 bytes and 50,000 merges."""
    ranks = {token: rank for rank, token in enumerate(ranked)}
    merges = []
    for rank, token in enumerate(ranked):
        if len(token) > 1:
            parts = bpe(token, ranks, rank)
            if len(parts) != 2:
                raise TokenizerError(f"token {rank} ({token!r}) is not a merge of two tokens of lower rank: "
                                     f"these are not BPE ranks")
            merges.append(tuple(parts))
    return merges
