"""Data loaders: one global sample stream whatever the number of ranks, resumable, and the eval batches."""
import os
import re

import numpy as np
import pytest

from llm import formats
from llm.data import DataError, DataLoader, EvalLoader, score, shared_files_warning
from llm.config import GPT2_EOT as EOT

T = 8
# Shard s holds the tokens 1000*s + 0, 1, 2, ..., so a token names its shard and position.
# 41, 28 and 46 tokens hold 5, 3 and 5 samples of T+1 = 9 tokens: 13 per epoch, which no
# global batch of 6 divides, so batches run across the end of an epoch.
SHARD_SIZES = (41, 28, 46)
SAMPLES = 13


@pytest.fixture
def pattern(tmp_path):
    for s, ntok in enumerate(SHARD_SIZES):
        formats.write_shard(tmp_path / f"train_{s:06d}.bin", 1000 * s + np.arange(ntok, dtype=np.uint16))
    return str(tmp_path / "train_*.bin")


def global_batches(pattern, N, B, steps, shuffle, state=None, seed=42):
    """The global batches of `steps` calls on N ranks of B each: rank slices stacked, (N*B, T) inputs."""
    loaders = [DataLoader(pattern, B, T, rank, N, shuffle, seed=seed) for rank in range(N)]
    for loader in loaders:
        if state is not None:
            loader.set_state(state)
    batches = [np.concatenate([loader.next_batch()[0] for loader in loaders]) for _ in range(steps)]
    return batches, loaders[0].state()


def first_tokens(batches):
    """Each sample's first token, which names it (1000*shard + start), in stream order."""
    return [int(t) for batch in batches for t in batch[:, 0]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_global_batch_order_is_independent_of_the_number_of_ranks(pattern, shuffle):
    # global batch of 6 = 1 x 6 = 2 x 3 = 3 x 2; 9 steps are 54 samples, a little over 4 epochs
    one, _ = global_batches(pattern, 1, 6, 9, shuffle)
    for N, B in [(2, 3), (3, 2)]:
        many, _ = global_batches(pattern, N, B, 9, shuffle)
        for a, b in zip(one, many):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shuffle", [False, True])
def test_n_ranks_equal_one_rank_with_n_times_the_batch_or_n_micro_steps(pattern, shuffle):
    N, B = 3, 2
    many, _ = global_batches(pattern, N, B, 5, shuffle)
    wide, _ = global_batches(pattern, 1, N * B, 5, shuffle)
    micro, _ = global_batches(pattern, 1, B, 5 * N, shuffle)
    micro = [np.concatenate(micro[i:i + N]) for i in range(0, len(micro), N)]
    assert first_tokens(many) == first_tokens(wide) == first_tokens(micro)
    for a, b, c in zip(many, wide, micro):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_targets_are_inputs_shifted_by_one_and_samples_stay_inside_a_shard(pattern):
    loader = DataLoader(pattern, 4, T, shuffle=True)
    for _ in range(10):
        inputs, targets = loader.next_batch()
        assert inputs.dtype == targets.dtype == np.int32 and inputs.shape == targets.shape == (4, T)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        # consecutive token values mean consecutive positions of one shard (shards are 1000 apart)
        np.testing.assert_array_equal(targets, inputs + 1)
        assert (inputs[:, 0] % 1000 % T == 0).all()   # a sample starts at a multiple of T


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epoch_visits_every_sample_exactly_once(pattern, shuffle):
    loader = DataLoader(pattern, 1, T, shuffle=shuffle)
    assert loader.num_samples == SAMPLES and loader.tokens_per_epoch == SAMPLES * T
    epoch = first_tokens([loader.next_batch()[0] for _ in range(SAMPLES)])
    every = [1000 * s + j * T for s, ntok in enumerate(SHARD_SIZES) for j in range((ntok - 1) // T)]
    assert sorted(epoch) == every
    if not shuffle:
        assert epoch == every
    assert loader.state() == (1, 0)


def test_shuffle_differs_between_epochs_and_is_fixed_by_the_seed(pattern):
    two_epochs = first_tokens(global_batches(pattern, 1, 1, 2 * SAMPLES, True)[0])
    assert two_epochs[:SAMPLES] != two_epochs[SAMPLES:]
    assert sorted(two_epochs[:SAMPLES]) == sorted(two_epochs[SAMPLES:])
    assert two_epochs == first_tokens(global_batches(pattern, 1, 1, 2 * SAMPLES, True)[0])
    assert two_epochs != first_tokens(global_batches(pattern, 1, 1, 2 * SAMPLES, True, seed=7)[0])


@pytest.mark.parametrize("resume_ranks", [(1, 6), (2, 3), (3, 2)])
def test_resume_from_state_continues_the_same_stream_on_any_world_size(pattern, resume_ranks):
    N, B = resume_ranks
    straight, _ = global_batches(pattern, 2, 3, 7, True)
    head, state = global_batches(pattern, 2, 3, 3, True)
    assert state == (1, 5)   # 18 samples read: epoch 0 (13) and 5 of epoch 1
    tail, _ = global_batches(pattern, N, B, 4, True, state=state)
    for a, b in zip(straight, head + tail):
        np.testing.assert_array_equal(a, b)


def test_reset_and_state_round_trip(pattern):
    loader = DataLoader(pattern, 2, T, shuffle=True)
    first = loader.next_batch()[0]
    loader.next_batch()
    assert loader.state() == (0, 4)
    loader.reset()
    assert loader.state() == (0, 0)
    np.testing.assert_array_equal(loader.next_batch()[0], first)
    with pytest.raises(DataError, match="position 13"):
        loader.set_state((0, 13))


def test_no_matching_files_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no files match -i/-j pattern '.*nothing_\\*.bin'"):
        DataLoader(str(tmp_path / "nothing_*.bin"), 1, T)


def test_token_id_beyond_vocab_names_file_id_and_position(tmp_path):
    tokens = np.arange(50, dtype=np.uint16)
    tokens[37] = 50300
    path = tmp_path / "bad_000000.bin"
    formats.write_shard(path, tokens)
    with pytest.raises(DataError) as err:
        DataLoader(str(path), 1, T, vocab_size=50257)
    assert str(err.value) == f"{path}: token id 50300 at position 37 is >= vocab size 50257"
    with pytest.raises(DataError, match="token id 30 at position 30 is >= vocab size 30"):
        DataLoader(str(path), 1, T, vocab_size=30)   # the first bad id is the one named
    assert DataLoader(str(path), 1, T, vocab_size=50301).num_samples == 6


def test_too_few_samples_for_one_global_batch(pattern):
    DataLoader(pattern, 13, T)   # exactly one epoch per batch is fine
    with pytest.raises(DataError, match="has only 13 samples of T\\+1=9 tokens; "
                                       "a batch needs world_size\\*B = 2\\*7 = 14: lower -b or -t, or give "
                                       "it more data"):
        DataLoader(pattern, 7, T, rank=1, world_size=2)


# ---- shards that change while a run reads them ----

def test_a_shard_prepared_anew_and_renamed_over_changes_nothing_for_a_running_loader(pattern, tmp_path):
    """data/*.py write a shard aside and rename it over the old name: the loader keeps reading the file it
    checked at start-up, through every later epoch (it once read the new file at its next epoch: other
    tokens, and an IndexError where the new one was shorter)."""
    straight = first_tokens(global_batches(pattern, 1, 3, 12, True)[0])   # 36 samples: into a third epoch
    loader = DataLoader(pattern, 3, T, shuffle=True)
    batches = [loader.next_batch()[0] for _ in range(2)]
    formats.write_shard(tmp_path / "train_000001.bin", 7 * np.ones(12, dtype=np.uint16))   # 1 sample, not 3
    batches += [loader.next_batch()[0] for _ in range(10)]
    assert first_tokens(batches) == straight


@pytest.mark.parametrize("change", ["truncated", "rewritten in place"])
def test_a_shard_changed_in_place_is_one_line_at_the_next_read(pattern, tmp_path, change):
    """A memory map meets a truncated file as SIGBUS, a death with no message; a file rewritten in place
    would feed other tokens, maybe ids past the vocab, unchecked."""
    loader = DataLoader(pattern, 3, T)
    loader.next_batch()
    path = tmp_path / "train_000000.bin"
    if change == "truncated":
        os.truncate(path, 1024 + 2 * 20)
    else:
        with open(path, "r+b") as f:   # as llm.c's data scripts write: same size, new tokens
            f.seek(1024)
            f.write(np.full(41, 60000, dtype="<u2").tobytes())
        os.utime(path, ns=(0, 10**9))   # a new modification time (the clock may not tick within this test)
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}: changed while this run reads it"):
        loader.next_batch()


def test_a_loader_holds_more_shards_open_than_the_soft_limit_on_open_files(tmp_path):
    """A loader keeps every shard open, and FineWeb's sample-100BT has about 1,000 shards, where the usual
    soft limit is 1,024 open files: the loader raises the soft limit toward the hard one."""
    import resource
    for s in range(80):
        formats.write_shard(tmp_path / f"many_{s:06d}.bin", np.arange(T + 1, dtype=np.uint16))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
    try:
        assert DataLoader(str(tmp_path / "many_*.bin"), 1, T).num_samples == 80
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(80 + 1024, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_train_and_val_data_sharing_a_file_gets_a_warning(pattern, tmp_path):
    train = DataLoader(pattern, 1, T)
    os.symlink(tmp_path / "train_000002.bin", tmp_path / "val.bin")   # the same file by another name
    warning = shared_files_warning(train, DataLoader(str(tmp_path / "val.bin"), 1, T))
    assert warning == (f"WARNING: the train data (-i) and the val data (-j) share 1 file(s), "
                       f"{tmp_path}/train_000002.bin: the val loss is measured on data the model trains on")
    assert shared_files_warning(train, DataLoader(pattern, 1, T)).count("share 3 file(s)") == 1
    formats.write_shard(tmp_path / "other.bin", np.arange(41, dtype=np.uint16))   # the same bytes elsewhere
    assert shared_files_warning(train, DataLoader(str(tmp_path / "other.bin"), 1, T)) is None


# ---- multiple-choice eval ----

def eval_examples():
    """Five examples with contexts of 1..3 tokens and completions of 1..3 tokens, labels 0..3."""
    return [dict(label=label, context=list(range(10 * i + 1, 10 * i + 1 + (i % 3) + 1)),
                 completions=[[100 + 10 * i + c] * (c % 3 + 1) for c in range(4)])
            for i, label in enumerate([2, 0, 3, 1, 2])]


@pytest.fixture
def eval_path(tmp_path):
    path = tmp_path / "hellaswag_val.bin"
    formats.write_eval(path, eval_examples())
    return str(path)


def test_eval_batches_hold_context_plus_completion_with_mask_on_completion_targets(eval_path):
    loader = EvalLoader(eval_path, 9, T)   # 2 examples per batch, row 8 is padding
    assert loader.num_batches == len(loader) == 3
    batches = list(loader)
    inputs, targets, mask, labels, n_active = batches[0]
    assert inputs.shape == targets.shape == mask.shape == (9, T)
    assert inputs.dtype == targets.dtype == np.int32 and mask.dtype == np.float32
    assert labels == [2, 0] and n_active == 2
    # example 0: context [1], completions [100], [101, 101], [102, 102, 102], [103]
    np.testing.assert_array_equal(inputs[2], [1, 102, 102, EOT, EOT, EOT, EOT, EOT])
    np.testing.assert_array_equal(targets[2], [102, 102, 102, EOT, EOT, EOT, EOT, EOT])
    np.testing.assert_array_equal(mask[2], [1, 1, 1, 0, 0, 0, 0, 0])
    # example 1: context [11, 12], completion 1 is [111, 111]
    np.testing.assert_array_equal(inputs[5], [11, 12, 111, EOT, EOT, EOT, EOT, EOT])
    np.testing.assert_array_equal(targets[5], [12, 111, 111, EOT, EOT, EOT, EOT, EOT])
    np.testing.assert_array_equal(mask[5], [0, 1, 1, 0, 0, 0, 0, 0])
    assert (inputs[8] == EOT).all() and (mask[8] == 0).all()
    assert mask.sum(axis=1).tolist() == [1, 2, 3, 1, 1, 2, 3, 1, 0]
    _, _, mask, labels, n_active = batches[2]   # the fifth example alone
    assert labels == [2] and n_active == 1 and mask[4:].sum() == 0


def test_ranks_split_the_examples_into_consecutive_blocks(eval_path):
    # 5 examples on 2 ranks: rank 0 takes 0..2, rank 1 takes 3..4; both run 3 batches of 1 example
    rank0, rank1 = (list(EvalLoader(eval_path, 4, T, rank, 2)) for rank in range(2))
    assert len(rank0) == len(rank1) == 3
    assert [b[3] for b in rank0] == [[2], [0], [3]] and [b[3] for b in rank1] == [[1], [2], []]
    assert [b[4] for b in rank1] == [1, 1, 0]
    np.testing.assert_array_equal(rank1[0][0][0, :2], [31, EOT])        # example 3: [31] + [130]
    np.testing.assert_array_equal(rank1[1][0][1, :3], [41, 42, 141])    # example 4: [41, 42] + [141, 141]


def test_score_takes_the_argmin_of_mean_completion_loss_ties_to_lower_index():
    mask = np.zeros((8, T), dtype=np.float32)
    mask[:, 2:4] = 1
    mask[1, 4] = 1   # row 1 has three completion tokens
    losses = np.full((8, T), 9.0, dtype=np.float32)   # outside the mask: ignored
    losses[:4, 2:5] = [[2, 2, 0], [1, 1, 1], [3, 0, 0], [4, 4, 4]]   # means 2, 1, 1.5, 4 -> argmin 1
    losses[4:, 2:4] = 1.0                                             # all tie -> completion 0
    assert score(losses, mask, [1, 0], 2) == 2
    assert score(losses, mask, [2, 0], 2) == 1
    assert score(losses, mask, [1, 3], 2) == 1
    assert score(losses, mask, [1], 1) == 1   # only the active example counts


def test_eval_with_a_perfect_scorer_gets_every_example_right(eval_path):
    correct = 0
    for rank in range(3):
        for inputs, targets, mask, labels, n_active in EvalLoader(eval_path, 8, T, rank, 3):
            losses = np.ones((8, T), dtype=np.float32)
            for i, label in enumerate(labels):
                losses[4 * i + label] = 0.5
            correct += score(losses, mask, labels, n_active)
    assert correct == 5


def test_eval_errors_for_small_batches_long_examples_and_empty_contexts(eval_path, tmp_path):
    with pytest.raises(DataError, match="B >= 4"):
        EvalLoader(eval_path, 3, T)
    # example 2 has 3 context tokens and a 3-token completion: 6 tokens need T >= 5
    EvalLoader(eval_path, 4, 5)
    with pytest.raises(DataError, match="example 2 has 6 tokens .*more than T\\+1=5: use a larger -t "
                                       "\\(up to the model's max_seq_len\\), or leave the example out of "
                                       "the file"):
        EvalLoader(eval_path, 4, 4)
    empty = tmp_path / "empty_context.bin"
    formats.write_eval(empty, [dict(label=0, context=[], completions=[[1], [2], [3], [4]])])
    with pytest.raises(DataError, match="empty_context.bin: example 0 has an empty context"):
        EvalLoader(str(empty), 4, T)
