"""Data loaders: token shards -> (inputs, targets) batches, and the HellaSwag-style multiple-choice eval.

The training data is a set of token shards (llm.c's .bin format, see formats.py) matched by a glob pattern.
A *sample* is T+1 consecutive tokens of one shard, starting at a multiple of T: its first T tokens are the
inputs and its last T the targets, so every position predicts the next token. A shard of ntok tokens holds
(ntok - 1) // T samples; samples never cross a shard boundary.

The order of the samples does not depend on the number of ranks. There is one global stream: epoch e
visits the shards in an order and each shard's samples in an order (both shuffled when asked, from seeds
that name only the seed, the epoch and the shard), and the stream is the epochs one after another. Every
call to next_batch takes the next world_size*B samples of that stream, and rank r keeps rows [r*B, (r+1)*B).
So the global batches of a run on world_size ranks are those of a run on 1 rank with world_size times the
micro-steps, and a run can resume on a different number of ranks and continue the same stream.

llm.c differs here on purpose: it seeds each rank's shuffle with 42 + rank and lets each rank read its own
sub-slice of every sample, so its data order changes with the number of ranks.

A loader opens every shard once, when it is built, checks it whole, and from then on reads samples from
those open files (os.preadv), never by name again and never through a memory map. A shard that a data
script prepares anew, written aside and renamed over the old name, leaves the open file, and so the run,
as it was. A shard truncated or rewritten in place, which a memory map would meet as a SIGBUS, is seen
at the next read (its size or modification time moved) and stops the run with one line. Copying the
shards into memory would cost 200 MB for each FineWeb shard of 100M tokens, 20 GB for sample-10BT's 100.
"""
import glob
import math
import os
import resource

import numpy as np
import xxhash

from llm import formats
from llm.config import GPT2_EOT, GPT2_VOCAB
from llm.launch import UserError


class DataError(UserError):
    """A data file or pattern that cannot be used (no matches, bad token ids, too little data)."""


class DataLoader:
    """Batches of B samples of T+1 tokens for one rank, cut from one rank-independent global stream.

    pattern      glob of token shards (the -i / -j flags); matched files are used in sorted order
    B, T         micro-batch size and sequence length
    rank, world_size   this process's slice of every global batch of world_size*B samples
    shuffle      shuffle the shard order and the samples inside each shard, anew every epoch
    vocab_size   every token id must be below it (checked for every shard at init)
    seed         the shuffle's seed; epoch e and shard s draw from numpy Generators seeded
                 with (seed, e) for the shard order and (seed, e, s) for the sample order
    """

    def __init__(self, pattern, B, T, rank=0, world_size=1, shuffle=False, vocab_size=GPT2_VOCAB, seed=42):
        if B < 1 or T < 1:
            raise DataError(f"batch size B={B} and sequence length T={T} must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}")
        self.pattern, self.B, self.T = pattern, B, T
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed = shuffle, seed
        paths = sorted(glob.glob(pattern))
        if folders := [path for path in paths if os.path.isdir(path)]:
            raise DataError(f"-i/-j pattern '{pattern}' matches the folder {folders[0]}: name the shard "
                            f"files in it, as {os.path.join(folders[0], '*train*.bin')} for -i and "
                            f"{os.path.join(folders[0], '*val*.bin')} for -j")
        if not paths:
            where = "" if os.path.isabs(pattern) else f" in {os.getcwd()}"   # the folder it was looked for in
            raise DataError(f"no files match -i/-j pattern '{pattern}'{where}: {prepare_hint(pattern)}")
        # open and validate every shard now, so that a bad file fails at startup and not hours into a run,
        # and what was validated is what the run reads (the module docstring says why)
        _room_for_open_files(len(paths))
        self.shards = [Shard(path, vocab_size) for path in paths]
        self.shard_samples = np.array([max(s.ntok - 1, 0) // T for s in self.shards], dtype=np.int64)
        self.num_samples = int(self.shard_samples.sum())   # samples per epoch
        if self.num_samples < world_size * B:
            raise DataError(f"'{pattern}' ({len(self.shards)} shards) has only {self.num_samples} samples "
                            f"of T+1={T + 1} tokens; a batch needs world_size*B = {world_size}*{B} = "
                            f"{world_size * B}: lower -b or -t, or give it more data")
        self._epoch_order = None   # (epoch, shard order, first stream position of each shard in it)
        self._shard = None         # (epoch, shard index, sample order or None)
        self.reset()

    def files(self):
        """{path: what this rank read there}, for the ranks to compare (llm/agreement.py)."""
        return {shard.path: f"{shard.ntok:,} tokens, checksum {shard.checksum:016x}"
                for shard in self.shards}

    @property
    def tokens_per_epoch(self):
        """Target tokens in one epoch: num_samples * T."""
        return self.num_samples * self.T

    def reset(self):
        """Back to the start of epoch 0."""
        self._next = 0   # index of the next unread sample in the stream: epoch * num_samples + position

    def state(self):
        """(epoch, position): the epoch being read and how many of its samples are consumed."""
        epoch, position = divmod(self._next, self.num_samples)
        return int(epoch), int(position)

    def set_state(self, state):
        """Continue from a state() (taken with any world_size: the stream is the same)."""
        epoch, position = (int(x) for x in state)
        if epoch < 0 or not 0 <= position < self.num_samples:
            raise DataError(f"loader state (epoch {epoch}, position {position}) does not fit "
                            f"'{self.pattern}', which has {self.num_samples} samples per epoch")
        self._next = epoch * self.num_samples + position

    def next_batch(self):
        """This rank's B samples of the next global batch: inputs and targets, int32 (B, T)."""
        B, T = self.B, self.T
        first = self._next + self.rank * B
        rows = np.empty((B, T + 1), dtype=np.int32)
        for b in range(B):
            rows[b] = self._sample(first + b)
        self._next += self.world_size * B
        return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])

    def _sample(self, index):
        """The T+1 tokens of stream sample `index`, read from its shard."""
        epoch, position = divmod(index, self.num_samples)
        order, starts = self._shard_order(epoch)
        k = int(np.searchsorted(starts, position, side="right")) - 1   # skips shards holding no samples
        s = int(order[k])
        sample_order = self._enter_shard(epoch, s)
        i = position - int(starts[k])
        j = i if sample_order is None else int(sample_order[i])
        return self.shards[s].read(j * self.T, self.T + 1)

    def _shard_order(self, epoch):
        """Epoch's shard order and, for each shard in that order, the stream position of its first sample."""
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            n = len(self.shards)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            starts = np.concatenate([[0], np.cumsum(self.shard_samples[order])[:-1]])
            self._epoch_order = (epoch, order, starts)
        return self._epoch_order[1:]

    def _enter_shard(self, epoch, s):
        """Shard s's sample order for this epoch (None: in order); kept until the next shard is entered."""
        if self._shard is None or self._shard[:2] != (epoch, s):
            sample_order = None
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch, s])
                sample_order = rng.permutation(int(self.shard_samples[s]))
            self._shard = (epoch, s, sample_order)
        return self._shard[2]


class Shard:
    """One token shard, opened and checked whole at start-up: ntok tokens, every id below vocab_size, and
    the checksum (xxh3_64) of its tokens, by which ranks confirm they read the same data.

    read() takes tokens from the file opened then, so a file renamed over `path` later changes nothing;
    a change to the opened file itself (truncated, rewritten in place) is a DataError at the next read."""
    SCAN_TOKENS = 1 << 24   # the start-up check reads 32 MB at a time

    def __init__(self, path, vocab_size):
        self.path = path
        self.file, self.ntok = formats.open_shard(path)   # FormatError for a bad header or size
        self.stamp = self._stamp()
        buffer = np.empty(min(self.SCAN_TOKENS, self.ntok), dtype="<u2")
        hasher = xxhash.xxh3_64()
        for first in range(0, self.ntok, self.SCAN_TOKENS):
            tokens = self.read(first, min(self.SCAN_TOKENS, self.ntok - first), buffer)
            hasher.update(tokens)
            if int(tokens.max()) >= vocab_size:
                position = first + int(np.argmax(tokens >= vocab_size))
                raise DataError(f"{path}: token id {int(tokens[position - first])} at position {position} "
                                f"is >= vocab size {vocab_size}")
        self.checksum = hasher.intdigest()

    def _stamp(self):
        """What changes when the opened file does: its size and modification time."""
        st = os.fstat(self.file.fileno())
        return st.st_size, st.st_mtime_ns

    @property
    def identity(self):
        """(device, inode): the same file under any name."""
        st = os.fstat(self.file.fileno())
        return st.st_dev, st.st_ino

    def read(self, first, count, buffer=None):
        """Tokens first..first+count-1 as uint16 (in `buffer`, if given), from the file opened at start-up."""
        tokens = np.empty(count, dtype="<u2") if buffer is None else buffer[:count]
        if os.preadv(self.file.fileno(), [tokens], formats.HEADER_BYTES + 2 * first) != 2 * count or \
                self._stamp() != self.stamp:
            raise DataError(f"{self.path}: changed while this run reads it (truncated or written in place "
                            f"since start-up): restore it, or write new shards aside and rename them over "
                            f"(as data/*.py do), then -y 1 resumes from the last checkpoint")
        return tokens


def _room_for_open_files(n):
    """Let this process hold n shards open and 1,024 other files: FineWeb's sample-100BT makes about 1,000
    shards, and the usual soft limit on open files is 1,024. The soft limit is raised as far as the hard
    limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 1024 if hard == resource.RLIM_INFINITY else min(n + 1024, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def shared_files_warning(train, val):
    """A warning line when the train and val loaders read a file in common (by any name), else None."""
    val_files = {shard.identity for shard in val.shards}
    shared = [shard.path for shard in train.shards if shard.identity in val_files]
    if shared:
        return (f"WARNING: the train data (-i) and the val data (-j) share {len(shared)} file(s), {shared[0]}"
                f"{', ...' if len(shared) > 1 else ''}: the val loss is measured on data the model trains on")


def prepare_hint(pattern):
    """Which command writes the shards of a pattern in llm.c's data folders (data/*.py write them)."""
    if "tinyshakespeare" in pattern:
        return "run `make data` (or python -m data.tinyshakespeare) to write them"
    if "fineweb" in pattern:
        flags = "".join(flag for key, flag in (("edu_", " --type edu"), ("100B", " --version 100B"))
                        if key in pattern)
        return f"run python -m data.fineweb{flags} to write them"
    return ("the scripts in data/ write shards (`make data`: tiny Shakespeare; python -m data.fineweb: "
            "FineWeb)")


class EvalLoader:
    """Batches of a multiple-choice eval file (HellaSwag: a context and 4 completions, one correct).

    Rank r takes ceil(num_examples / world_size) consecutive examples. Each batch packs floor(B/4) examples
    into 4 rows each: row 4i+c holds example i's context followed by completion c, its targets are the row
    shifted by one (the last context token predicts the first completion token), and mask is 1 at the
    targets that are completion tokens. Unused rows and positions hold eot (GPT-2's 50256) with mask 0.
    Every rank yields the same number of batches (num_batches); a batch's examples beyond n_active are
    padding. Iterating yields (inputs int32 (B,T), targets int32 (B,T), mask float32 (B,T), labels,
    n_active), where labels lists the n_active correct completions. Every token id must be below
    vocab_size (checked for every example at init).
    """

    def __init__(self, path, B, T, rank=0, world_size=1, vocab_size=GPT2_VOCAB, eot=GPT2_EOT):
        if B < 4:
            raise DataError(f"the eval needs B >= 4 (4 rows per example), got B={B}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}")
        self.path, self.B, self.T, self.eot = path, B, T, eot
        examples = formats.read_eval(path)
        if not examples:   # an accuracy of 0 correct out of 0
            raise DataError(f"{path}: holds no examples: write it anew with python -m data.hellaswag")
        for i, ex in enumerate(examples):
            _check_example(path, i, ex, T, vocab_size)
        self.num_examples = len(examples)
        per_rank = math.ceil(self.num_examples / world_size)
        self.examples = examples[rank * per_rank:(rank + 1) * per_rank]
        self.examples_per_batch = B // 4
        self.num_batches = math.ceil(per_rank / self.examples_per_batch)

    def __len__(self):
        return self.num_batches

    def files(self):
        """{path: what this rank read there}, for the ranks to compare (llm/agreement.py)."""
        return {self.path: f"{self.num_examples:,} examples, {os.path.getsize(self.path):,} bytes"}

    def __iter__(self):
        B, T, E = self.B, self.T, self.examples_per_batch
        for first in range(0, self.num_batches * E, E):
            batch = self.examples[first:first + E]
            inputs = np.full((B, T), self.eot, dtype=np.int32)
            targets = np.full((B, T), self.eot, dtype=np.int32)
            mask = np.zeros((B, T), dtype=np.float32)
            for i, ex in enumerate(batch):
                ctx = ex["context"]
                for c, completion in enumerate(ex["completions"]):
                    row = ctx + completion
                    b = 4 * i + c
                    inputs[b, :len(row) - 1] = row[:-1]
                    targets[b, :len(row) - 1] = row[1:]
                    mask[b, len(ctx) - 1:len(row) - 1] = 1.0   # targets that are completion tokens
            yield inputs, targets, mask, [ex["label"] for ex in batch], len(batch)


def _check_example(path, i, ex, T, vocab_size):
    """An example needs a context and non-empty completions (read_eval checks there are 4), token ids
    below vocab_size, and rows that fit T+1 tokens: T inputs and the T targets shifted by one."""
    ctx, completions = ex["context"], ex["completions"]
    if not ctx or not all(completions):
        raise DataError(f"{path}: example {i} has an empty context or an empty completion")
    largest = max(max(ctx), *(max(c) for c in completions))
    if largest >= vocab_size:
        raise DataError(f"{path}: example {i} has token id {largest}, >= the model's vocab size {vocab_size}")
    longest = len(ctx) + max(len(c) for c in completions)
    if longest > T + 1:
        raise DataError(f"{path}: example {i} has {longest} tokens (context + completion), "
                        f"more than T+1={T + 1}: use a larger -t (up to the model's max_seq_len), or leave "
                        f"the example out of the file")


def score(losses, mask, labels, n_active):
    """Number of the first n_active examples whose lowest-loss completion is the labelled one.

    losses (B, T) per-token losses of an EvalLoader batch. A completion's score is its mean loss over
    the mask; the prediction is the argmin, ties going to the lower index.
    """
    rows = 4 * n_active
    completion_loss = (losses[:rows] * mask[:rows]).sum(axis=1) / mask[:rows].sum(axis=1)
    predictions = completion_loss.reshape(n_active, 4).argmin(axis=1)
    return int((predictions == np.asarray(labels[:n_active])).sum())
