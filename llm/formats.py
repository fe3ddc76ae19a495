"""Every llm.c file format: one writer and one reader for each, sharing one header helper.

Every file starts with a header of 256 little-endian int32 (1024 bytes): slot 0 is the magic number
that names the format, slot 1 its version, the next slots hold sizes, and unused slots are 0.
The payload follows directly after the header.

  format               magic     version  header slots                    payload
  model checkpoint     20240326  3 or 5   2..7 maxT V L NH C Vp           params: fp32 (v3) or bf16 bits (v5)
  training state       20240527  1        see "Training state file"       m, v, [master]: fp32
  debug state          20240327  2        2 B, 3 T                        x, y int32; logits, loss, grads fp32
  tokenizer            20240328  1 or 2   2 n tokens, 3 EOT id (v2)       per token: uint8 length, raw bytes
  token data shard     20240520  1        2 ntok                          ntok uint16 tokens
  eval (HellaSwag)     20240522  1        2 examples, 3 longest bytes     a uint16 stream of examples

Readers raise FormatError, one line naming the file and the problem, for anything a user can get
wrong: a missing file, the wrong kind of file, an unknown version, a size the header disagrees with,
and, in model and state files, values no training run can produce (NaN or infinite parameters, a
negative second moment, a model of zeros), which a damaged or foreign file of the right size holds.
Writers go through atomic_write (or atomic_path), so a writer killed half way never leaves a broken file
behind.

The model and state files we write also prove their own bytes: a checksum of the whole file sits in
header slots that llm.c neither writes nor reads (see "Checksums" below), and a reader verifies it.
llm.c's files carry none and load as before.
"""
from contextlib import contextmanager, suppress
import os

import numpy as np
import xxhash

from llm.config import GPT2_EOT, ConfigError, GPT2Config
from llm.launch import UserError
from llm.layout import tensor_at

HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
STATE_MAGIC = 20240527
STATE_VERSION = 1
DEBUG_STATE_MAGIC = 20240327
DEBUG_STATE_VERSION = 2
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION_NO_EOT = 1
TOKENIZER_VERSION = 2
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
LLAMA3_SHARD_MAGIC = 20240801    # llm.c's uint32-token variant; named only to explain a refusal
EVAL_MAGIC = 20240522
EVAL_VERSION = 1

# What each magic number means, for error messages.
FORMAT_NAMES = {
    MODEL_MAGIC: "an llm.c model checkpoint",
    STATE_MAGIC: "an llm.c training state file",
    DEBUG_STATE_MAGIC: "an llm.c debug state file",
    TOKENIZER_MAGIC: "an llm.c tokenizer file",
    SHARD_MAGIC: "an llm.c token data shard",
    LLAMA3_SHARD_MAGIC: "a Llama-3 token data shard (uint32 tokens, not supported)",
    EVAL_MAGIC: "an llm.c eval file",
}

MODEL_VERSIONS = {MODEL_VERSION_FP32: "fp32", MODEL_VERSION_BF16: "bf16"}
MODEL_DTYPES = {MODEL_VERSION_FP32: np.dtype("<f4"), MODEL_VERSION_BF16: np.dtype("<u2")}
EVAL_START = 65535                # marks the start of each example in an eval file
EVAL_COMPLETIONS = 4              # HellaSwag: every example has 4 candidate endings
MAX_SHARD_TOKENS = 2**31 - 1      # ntok lives in an int32 slot


class FormatError(UserError):
    """A file that is missing, of the wrong kind, or inconsistent with its header.

    The message is one line, "<file>: <problem>", fit to print without a traceback."""


# ----------------------------------------------------------------------------------------------
# Shared machinery: atomic writes, headers, payload sizes

def temporary_path(path):
    """Where atomic_write puts the bytes of `path` until they are complete: `path`.<pid>.tmp (the pid
    keeps two processes writing one name apart)."""
    return f"{os.fspath(path)}.{os.getpid()}.tmp"


@contextmanager
def atomic_path(path):
    """A temporary name to write `path` under, so that it appears complete or not at all.

    The temporary file is in the same directory; once the body has written it, it is fsync'ed and renamed
    onto `path` (a rename within one file system is atomic), and the directory is fsync'ed so the rename
    itself survives a power cut. If the body raises, the temporary file is removed and whatever was at
    `path` before is left untouched. For writers that take a file name (safetensors' save_file)."""
    path = os.fspath(path)
    tmp = temporary_path(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(FileNotFoundError):
            os.remove(tmp)
        if isinstance(e, OSError) and e.filename == tmp:   # say the name the user knows, not ours
            raise OSError(e.errno, e.strerror, path) from None
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@contextmanager
def atomic_write(path):
    """Open `path` for binary writing through atomic_path: it appears complete or not at all."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


def new_header(magic, version):
    """A zeroed 256-int32 header with the magic and version in slots 0 and 1."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1] = magic, version
    return header


def _set64(header, slot, value, dtype="<i8"):
    """Store a 64-bit value in two int32 slots, low word first (how llm.c stores size_t/uint64)."""
    header[slot:slot + 2].view(dtype)[0] = value


def _get64(header, slot, dtype="<i8"):
    return int(header[slot:slot + 2].view(dtype)[0])


def _describe_versions(versions):
    """{3: "fp32", 5: "bf16"} -> "3 (fp32) or 5 (bf16)"."""
    return " or ".join(f"{v} ({what})" if what else str(v) for v, what in versions.items())


def this_is(magic):
    """"; this is an llm.c tokenizer file" for one of FORMAT_NAMES' magics, else ""."""
    return f"; this is {FORMAT_NAMES[magic]}" if magic in FORMAT_NAMES else ""


def what_it_is(path):
    """this_is() of the magic a file begins with ("" where it cannot be read)."""
    with suppress(OSError):
        with open(path, "rb") as f:
            return this_is(np.frombuffer(f.read(4).ljust(4, b"\0"), dtype="<i4")[0])
    return ""


@contextmanager
def open_llmc(path, magic, versions):
    """Open an llm.c file and check its header's magic and version.

    `versions` maps each accepted version to a short description (or ""). Yields (f, header,
    payload_bytes) with f positioned at the start of the payload."""
    if os.path.exists(path) and not os.path.isfile(path):   # a directory, or a pipe that open() would wait on
        raise FormatError(f"{path}: not a file")
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except OSError as e:
        raise FormatError(f"{path}: cannot read ({e.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_BYTES:
            raise FormatError(f"{path}: truncated: the file has {size} bytes, "
                              f"less than the {HEADER_BYTES}-byte header")
        header = np.fromfile(f, dtype="<i4", count=HEADER_INTS)
        if header[0] != magic:
            raise FormatError(f"{path}: bad magic {header[0]} (expected {magic}: {FORMAT_NAMES[magic]})"
                              f"{this_is(header[0])}")
        if header[1] not in versions:
            raise FormatError(f"{path}: unknown version {header[1]} "
                              f"(expected {_describe_versions(versions)})")
        yield f, header, size - HEADER_BYTES


def check_payload_size(path, payload_bytes, expected_bytes, what):
    """The payload must be exactly what the header describes (`what`, e.g. "1000 parameters")."""
    if payload_bytes < expected_bytes:
        raise FormatError(f"{path}: truncated: header says {what} ({expected_bytes} bytes) "
                          f"but the file has {payload_bytes} bytes of payload")
    if payload_bytes > expected_bytes:
        raise FormatError(f"{path}: file size disagrees with header: header says {what} "
                          f"({expected_bytes} bytes) but the file has {payload_bytes} bytes "
                          f"of payload ({payload_bytes - expected_bytes} extra bytes)")


def check_counts(path, minimum=0, **counts):
    """The sizes a header gives (B=..., T=...) must each be at least `minimum`: one below it means the
    header is damaged, and arrays of that size cannot be made."""
    if any(n < minimum for n in counts.values()):
        said = ", ".join(f"{name}={n}" for name, n in counts.items())
        raise FormatError(f"{path}: header says {said}, less than {minimum}: the file is damaged")


def all_finite(x):
    """Whether a float array holds no NaN and no inf: its float64 sum is finite exactly then (a float32
    sum could overflow), and summing needs no array-sized temporary."""
    return bool(np.isfinite(np.sum(x, dtype=np.float64)))


def check_finite(path, x, what, locate=lambda i: f"at index {i}"):
    """Raise FormatError naming the file when float array x (`what`: "m", "the model") holds NaN or inf;
    locate(i) says where the first one is."""
    if not all_finite(x):
        bad = np.flatnonzero(~np.isfinite(x))
        raise FormatError(f"{path}: {what} holds NaN or infinite values ({bad.size}, "
                          f"the first {locate(bad[0])}): the file is damaged")


def _write_array(f, array, dtype):
    """Write an array's elements as `dtype`, without a copy when it already is that dtype."""
    f.write(np.ascontiguousarray(array, dtype=dtype).data)


# ----------------------------------------------------------------------------------------------
# Checksums: a model or state file we write proves its own bytes
#
# llm.c leaves the last slots of both headers 0 and never reads them; we keep there
#   250-251  the run id (uint64) of the run that wrote the file (0: not recorded)
#   252      the checksum's kind: 1 = xxh3_64, chosen for its speed (bench/checksum.py: about 14 GB/s
#            on one core, where zlib's crc32 makes 2.8); 0 = none, as in llm.c's files, which load unverified
#   254-255  the checksum (uint64) of the whole file, header included, with slots 254-255 read as 0
# A bit flipped anywhere, a zero-filled payload, a data position moved in the header: the file no
# longer matches its checksum. The state file also records its model file's checksum (see below).

SLOT_RUN_ID = 250
SLOT_CHECKSUM_KIND = 252
SLOT_CHECKSUM = 254
CHECKSUM_XXH3 = 1


def _checksum(header, arrays):
    """xxh3_64 of a file made of `header` (its checksum slots read as 0) followed by `arrays`' bytes."""
    header = header.copy()
    header[SLOT_CHECKSUM:SLOT_CHECKSUM + 2] = 0
    hasher = xxhash.xxh3_64(header.tobytes())
    for array in arrays:
        hasher.update(array)   # streams: hashing a, then b equals hashing their concatenation
    return hasher.intdigest()


def _write_checksummed(path, header, arrays, run_id):
    """Write `header` then `arrays` (contiguous, already in their file dtypes), with the run id and the
    file's checksum in the header; -> the checksum."""
    _set64(header, SLOT_RUN_ID, run_id, "<u8")
    header[SLOT_CHECKSUM_KIND] = CHECKSUM_XXH3
    checksum = _checksum(header, arrays)
    _set64(header, SLOT_CHECKSUM, checksum, "<u8")
    with atomic_write(path) as f:
        f.write(header.tobytes())
        for array in arrays:
            _write_array(f, array, array.dtype)
    return checksum


def _verify(path, header, arrays):
    """-> the checksum of a file read as `header` and `arrays`; FormatError if the file records another
    one. A file that records none (llm.c's) passes: the checksum is still returned, to compare copies."""
    checksum = _checksum(header, arrays)
    kind, recorded = int(header[SLOT_CHECKSUM_KIND]), _get64(header, SLOT_CHECKSUM, "<u8")
    if kind == recorded == 0:
        return checksum
    if kind != CHECKSUM_XXH3:
        raise FormatError(f"{path}: unknown checksum kind {kind} in header slot {SLOT_CHECKSUM_KIND}: "
                          f"the file is damaged")
    if recorded != checksum:
        raise FormatError(f"{path}: its bytes do not match the checksum it records ({recorded:016x}, they "
                          f"give {checksum:016x}): the file is damaged")
    return checksum


# ----------------------------------------------------------------------------------------------
# bf16: the top 16 bits of a float32

def float32_to_bf16_bits(x):
    """float32 -> bf16 bit patterns (uint16), rounding to nearest, ties to even, as torch does.

    Adding 0x7FFF plus the lowest kept bit before dropping the low 16 bits rounds up exactly when
    the dropped half is above 0x8000, or equal to it with the kept part odd. Overflow carries into
    the exponent, so values past bf16's range become inf. NaN becomes the quiet NaN 0x7FC0 (plain
    rounding could carry a NaN with small payload into inf)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    rounded[np.isnan(x)] = 0x7FC0
    return rounded


def bf16_bits_to_float32(bits):
    """bf16 bit patterns (uint16) -> float32, exactly (bf16 is float32 with 16 fewer mantissa bits)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------------------------
# Model checkpoint: the config, then the flat parameter buffer (llm/layout.py's 16 tensors)

def write_model(path, config, params, version=MODEL_VERSION_FP32, run_id=0):
    """Write `params`, the flat float32 buffer of config.num_parameters, as version 3 (fp32) or 5 (bf16),
    with the run id and the file's checksum in the header; -> the checksum."""
    if version not in MODEL_VERSIONS:
        raise ValueError(f"model version must be {_describe_versions(MODEL_VERSIONS)}, not {version}")
    params = np.asarray(params)
    if params.shape != (config.num_parameters,):
        raise ValueError(f"params has shape {params.shape}, expected ({config.num_parameters},)")
    header = new_header(MODEL_MAGIC, version)
    header[2:8] = (config.max_seq_len, config.vocab_size, config.num_layers,
                   config.num_heads, config.channels, config.padded_vocab_size)
    payload = float32_to_bf16_bits(params) if version == MODEL_VERSION_BF16 else \
        np.ascontiguousarray(params, dtype="<f4")
    return _write_checksummed(path, header, [payload], run_id)


def _model_config(path, header, payload_bytes):
    """-> (config, version) from a model file's header, whose sizes the file's must match: a damaged size
    would otherwise pass for another model (and, before any read, for one too large for the memory)."""
    maxT, V, L, NH, C, Vp = (int(s) for s in header[2:8])
    try:
        config = GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp, num_layers=L, num_heads=NH,
                            channels=C)
    except ConfigError as e:
        raise FormatError(f"{path}: header describes an impossible model: {e}") from None
    version, n = int(header[1]), config.num_parameters
    check_payload_size(path, payload_bytes, n * MODEL_DTYPES[version].itemsize, f"{n} parameters")
    return config, version


def read_model_config(path):
    """-> (config, version) from a model file's header, without reading its parameters (to check the model
    and count the memory first)."""
    with open_llmc(path, MODEL_MAGIC, MODEL_VERSIONS) as (_, header, payload_bytes):
        return _model_config(path, header, payload_bytes)


def read_model(path):
    """-> (config, params, version); params is float32 (num_parameters,) whatever the file's version.
    A file that records a checksum must match it."""
    with open_llmc(path, MODEL_MAGIC, MODEL_VERSIONS) as (f, header, payload_bytes):
        config, version = _model_config(path, header, payload_bytes)
        params = np.fromfile(f, dtype=MODEL_DTYPES[version], count=config.num_parameters)
    _verify(path, header, [params])
    if version == MODEL_VERSION_BF16:
        params = bf16_bits_to_float32(params)
    check_finite(path, params, "the model", lambda i: "in " + tensor_at(config, i))
    if not params.any():
        raise FormatError(f"{path}: every parameter is 0, as in no model (a file zero-filled by a crash?): "
                          f"the file is damaged")
    return config, params, version


def model_checksum(path):
    """The checksum a model file records in its header, or None (llm.c's files record none). read_model
    has verified it against the bytes, so it names them: a state file records it to tie itself to them."""
    with open_llmc(path, MODEL_MAGIC, MODEL_VERSIONS) as (_, header, _):
        return _get64(header, SLOT_CHECKSUM, "<u8") or None


# ----------------------------------------------------------------------------------------------
# Training state file: the optimizer and data-loader state that goes with a model checkpoint
#
# It follows llm.c's state file (train_gpt2.cu save_state) slot for slot where the meaning carries over:
#   0 magic 20240527, 1 version 1, 2 num_processes, 3 process_rank, 4 use_master_weights (0/1),
#   5 should_shuffle (0/1), 10 step, 20-21 rng_state (uint64), 22-23 rng_state_last_update (uint64),
#   30-31 loader shard/epoch index (int64), 32-33 loader sample index (int64).
# Where we differ, and why:
#   - m, v and master are the FULL flat buffers of num_parameters fp32 each, in llm/layout.py's order.
#     llm.c writes one file per rank holding only that rank's ZeRO-1 shard; we gather the shards before
#     saving, so one state file resumes a run at any number of processes. num_processes and
#     process_rank record who wrote the file; they are not required to match on load.
#   - slots 40-49 are unused by llm.c; we keep there:
#       40-41 num_parameters (int64), so the reader can check the size
#       42-43 the train data's samples per epoch (int64) and 44 the sequence length T: the loader
#             position counts samples of T+1 tokens in that data, so a resume checks both still hold
#       45    non-finite steps in a row so far, 46 and 47 how many values the loss and the grad-norm
#             outlier windows hold (0..128): the -sl/-sg/--max-nonfinite decisions (llm/outliers.py)
#       48-49 the checksum of the model file saved with this state (uint64): it ties the two files of
#             one checkpoint together, so a model file of another step or run is refused
#     Files written before these fields have 0 in 42-49: no data check, empty windows, no tie, as then.
#     The run id and the state file's own checksum sit in 250-255, as in a model file (see Checksums).
#   - after master, llm.c appends the shuffled shard and sample orders and its Mersenne Twister
#     state. Our loader's order is recomputed from its seed and its position, so the two position
#     numbers are the whole loader state. Our payload ends with the loss window, then the grad-norm
#     window, as float64 (the detectors compute in double, as llm.c's): nothing when they are empty.

STATE_SLOT_NUM_PARAMETERS = 40
STATE_SLOT_SAMPLES_PER_EPOCH = 42
STATE_SLOT_SEQ_LEN = 44
STATE_SLOT_NONFINITE_STREAK = 45
STATE_SLOT_WINDOWS = 46
STATE_SLOT_MODEL_CHECKSUM = 48


def write_state(path, *, step, num_processes, rng_state, loader_state, m, v, master=None,
                should_shuffle=True, process_rank=0, rng_state_last_update=0, samples_per_epoch=0, seq_len=0,
                nonfinite_streak=0, loss_window=(), norm_window=(), model_checksum=0, run_id=0):
    """Write the training state; m, v and master (or None) are full float32 (num_parameters,) buffers;
    samples_per_epoch and seq_len describe what loader_state counts in; nonfinite_streak and the windows
    are llm/outliers.py's; model_checksum is write_model's answer for the model saved with this state.
    -> the state file's checksum."""
    n = np.size(m)
    for name, buffer in (("v", v), ("master", master)):
        if buffer is not None and np.size(buffer) != n:
            raise ValueError(f"{name} has {np.size(buffer)} elements but m has {n}")
    header = new_header(STATE_MAGIC, STATE_VERSION)
    header[2:6] = (num_processes, process_rank, master is not None, should_shuffle)
    header[10] = step
    _set64(header, 20, rng_state, "<u8")
    _set64(header, 22, rng_state_last_update, "<u8")
    _set64(header, 30, loader_state[0])
    _set64(header, 32, loader_state[1])
    _set64(header, STATE_SLOT_NUM_PARAMETERS, n)
    _set64(header, STATE_SLOT_SAMPLES_PER_EPOCH, samples_per_epoch)
    header[STATE_SLOT_SEQ_LEN] = seq_len
    header[STATE_SLOT_NONFINITE_STREAK] = nonfinite_streak
    header[STATE_SLOT_WINDOWS:STATE_SLOT_WINDOWS + 2] = (len(loss_window), len(norm_window))
    _set64(header, STATE_SLOT_MODEL_CHECKSUM, model_checksum, "<u8")
    buffers = [np.ascontiguousarray(b, dtype="<f4") for b in ((m, v) if master is None else (m, v, master))]
    windows = np.array(list(loss_window) + list(norm_window), dtype="<f8")
    return _write_checksummed(path, header, buffers + [windows], run_id)


def read_state(path, num_parameters):
    """-> dict(step, num_processes, process_rank, should_shuffle, rng_state, rng_state_last_update,
    loader_state=(shard/epoch index, sample index), samples_per_epoch, seq_len (0: not recorded),
    m, v, master=None or array, nonfinite_streak, loss_window, norm_window (lists of floats),
    checksum (of the file's bytes, verified against the one it records, if any), model_checksum (or
    None: not recorded), run_id (0: not recorded))."""
    with open_llmc(path, STATE_MAGIC, {STATE_VERSION: ""}) as (f, header, payload_bytes):
        n = _get64(header, STATE_SLOT_NUM_PARAMETERS)
        if n != num_parameters:
            raise FormatError(f"{path}: state is for a model with {n} parameters, "
                              f"but this model has {num_parameters}")
        use_master = bool(header[4])
        buffers = ("m", "v", "master") if use_master else ("m", "v")
        n_loss, n_norm = (int(x) for x in header[STATE_SLOT_WINDOWS:STATE_SLOT_WINDOWS + 2])
        if min(n_loss, n_norm, header[10], header[STATE_SLOT_NONFINITE_STREAK]) < 0:
            raise FormatError(f"{path}: negative step, window length or count in the header: "
                              f"the file is damaged")
        what = f"{'m, v and master' if use_master else 'm and v'} of {n} parameters"
        what += f" and outlier windows of {n_loss} and {n_norm} values" if n_loss + n_norm else ""
        check_payload_size(path, payload_bytes, 4 * n * len(buffers) + 8 * (n_loss + n_norm), what)
        state = {name: np.fromfile(f, dtype="<f4", count=n) for name in buffers}
        windows = np.fromfile(f, dtype="<f8", count=n_loss + n_norm)
    checksum = _verify(path, header, [*state.values(), windows])
    for name, buffer in state.items():
        check_finite(path, buffer, name)
    if n and state["v"].min() < 0:
        raise FormatError(f"{path}: v holds negative values ({int((state['v'] < 0).sum())}), "
                          f"and AdamW's second moment never is: the file is damaged")
    return dict(step=int(header[10]), num_processes=int(header[2]), process_rank=int(header[3]),
                should_shuffle=bool(header[5]), rng_state=_get64(header, 20, "<u8"),
                rng_state_last_update=_get64(header, 22, "<u8"),
                loader_state=(_get64(header, 30), _get64(header, 32)),
                samples_per_epoch=_get64(header, STATE_SLOT_SAMPLES_PER_EPOCH),
                seq_len=int(header[STATE_SLOT_SEQ_LEN]),
                m=state["m"], v=state["v"], master=state.get("master"),
                nonfinite_streak=int(header[STATE_SLOT_NONFINITE_STREAK]),
                loss_window=windows[:n_loss].tolist(), norm_window=windows[n_loss:].tolist(),
                checksum=checksum, model_checksum=_get64(header, STATE_SLOT_MODEL_CHECKSUM, "<u8") or None,
                run_id=_get64(header, SLOT_RUN_ID, "<u8"))


# ----------------------------------------------------------------------------------------------
# Debug state: one batch with PyTorch's logits, loss and gradients, to test a model against

def write_debug_state(path, x, y, logits, loss, grads):
    """x, y: int (B, T); logits: (B, T, V) over the real vocab, unpadded; loss: the mean loss;
    grads: the flat (num_parameters,) buffer, padded wte rows included."""
    x, y, logits = np.asarray(x), np.asarray(y), np.asarray(logits)
    B, T = x.shape
    if y.shape != (B, T) or logits.shape[:2] != (B, T) or logits.ndim != 3:
        raise ValueError(f"expected x, y of shape (B, T) and logits (B, T, V), got "
                         f"{x.shape}, {y.shape} and {logits.shape}")
    header = new_header(DEBUG_STATE_MAGIC, DEBUG_STATE_VERSION)
    header[2:4] = (B, T)
    with atomic_write(path) as f:
        f.write(header.tobytes())
        _write_array(f, x, "<i4")
        _write_array(f, y, "<i4")
        _write_array(f, logits, "<f4")
        _write_array(f, [loss], "<f4")
        _write_array(f, grads, "<f4")


def read_debug_state(path, config):
    """-> dict(x, y: int32 (B, T), logits: float32 (B, T, V), loss: float,
    grads: float32 (num_parameters,))."""
    versions = {DEBUG_STATE_VERSION: "padded vocab"}
    with open_llmc(path, DEBUG_STATE_MAGIC, versions) as (f, header, payload_bytes):
        B, T = int(header[2]), int(header[3])
        check_counts(path, 1, B=B, T=T)
        V, n = config.vocab_size, config.num_parameters
        check_payload_size(path, payload_bytes, 4 * (2 * B * T + B * T * V + 1 + n),
                           f"B={B}, T={T}; the model has V={V} and {n} parameters")
        x = np.fromfile(f, dtype="<i4", count=B * T).reshape(B, T)
        y = np.fromfile(f, dtype="<i4", count=B * T).reshape(B, T)
        logits = np.fromfile(f, dtype="<f4", count=B * T * V).reshape(B, T, V)
        loss = float(np.fromfile(f, dtype="<f4", count=1)[0])
        grads = np.fromfile(f, dtype="<f4", count=n)
    return dict(x=x, y=y, logits=logits, loss=loss, grads=grads)


# ----------------------------------------------------------------------------------------------
# Tokenizer: the byte string of every token id, for decoding

def check_vocab(name, n_tokens, expected):
    """A tokenizer of n_tokens must match the model's vocab_size `expected`."""
    if n_tokens != expected:
        raise FormatError(f"{name}: vocab mismatch: tokenizer has {n_tokens} tokens, "
                          f"model expects {expected}")


def write_tokenizer(path, token_bytes, eot_id):
    """Write version 2: token_bytes[i] is the byte string of token i (1 to 255 bytes), eot_id in slot 3."""
    for i, b in enumerate(token_bytes):
        if not 1 <= len(b) <= 255:
            raise FormatError(f"{path}: token {i} has {len(b)} bytes; the format stores 1 to 255")
    if not 0 <= eot_id < len(token_bytes):
        raise FormatError(f"{path}: EOT id {eot_id} is not one of the {len(token_bytes)} tokens")
    header = new_header(TOKENIZER_MAGIC, TOKENIZER_VERSION)
    header[2:4] = (len(token_bytes), eot_id)
    with atomic_write(path) as f:
        f.write(header.tobytes())
        f.write(b"".join(bytes([len(b)]) + b for b in token_bytes))


def read_tokenizer(path, expected_vocab=None):
    """-> (token_bytes, eot_id). With expected_vocab, the token count must equal it (check_vocab)."""
    versions = {TOKENIZER_VERSION_NO_EOT: "GPT-2, EOT 50256", TOKENIZER_VERSION: "EOT id in slot 3"}
    with open_llmc(path, TOKENIZER_MAGIC, versions) as (f, header, payload_bytes):
        n = int(header[2])
        check_counts(path, 1, tokens=n)
        if header[1] == TOKENIZER_VERSION_NO_EOT:
            if n != GPT2_EOT + 1:
                raise FormatError(f"{path}: a version 1 tokenizer must have {GPT2_EOT + 1} tokens, "
                                  f"this one has {n}")
            eot_id = GPT2_EOT
        else:
            eot_id = int(header[3])
        if expected_vocab is not None:
            check_vocab(path, n, expected_vocab)
        if not 0 <= eot_id < n:
            raise FormatError(f"{path}: EOT id {eot_id} is not one of the {n} tokens")
        payload = f.read()
    token_bytes, pos = [], 0
    for i in range(n):
        if pos >= len(payload) or pos + 1 + payload[pos] > len(payload):
            raise FormatError(f"{path}: truncated: header says {n} tokens but the payload "
                              f"({payload_bytes} bytes) ends inside token {i}")
        if payload[pos] == 0:
            raise FormatError(f"{path}: token {i} (at payload byte {pos}) has length 0")
        token_bytes.append(payload[pos + 1:pos + 1 + payload[pos]])
        pos += 1 + payload[pos]
    if pos != payload_bytes:
        raise FormatError(f"{path}: file size disagrees with header: {n} tokens end at payload byte {pos} "
                          f"but the file has {payload_bytes} bytes of payload "
                          f"({payload_bytes - pos} extra bytes)")
    return token_bytes, eot_id


# ----------------------------------------------------------------------------------------------
# Token data shard: a stream of uint16 token ids

def write_shard(path, tokens):
    """Write token ids (each 0..65535, fewer than 2^31 of them) as one shard."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size > MAX_SHARD_TOKENS:
        raise FormatError(f"{path}: a shard holds a 1-D list of fewer than 2^31 tokens, "
                          f"got shape {tokens.shape}")
    bad = np.flatnonzero((tokens < 0) | (tokens > 65535))
    if bad.size:
        raise FormatError(f"{path}: token id {tokens[bad[0]]} at position {bad[0]} does not fit in "
                          f"uint16 (a shard holds ids 0..65535)")
    header = new_header(SHARD_MAGIC, SHARD_VERSION)
    header[2] = tokens.size
    with atomic_write(path) as f:
        f.write(header.tobytes())
        _write_array(f, tokens, "<u2")


def open_shard(path):
    """-> (file, ntok): the shard open for reading (unbuffered; the caller closes it), after checking that
    it holds exactly the ntok tokens its header says."""
    with open_llmc(path, SHARD_MAGIC, {SHARD_VERSION: ""}) as (f, header, payload_bytes):
        ntok = int(header[2])
        check_counts(path, tokens=ntok)
        check_payload_size(path, payload_bytes, 2 * ntok, f"{ntok} tokens")
        return os.fdopen(os.dup(f.fileno()), "rb", buffering=0), ntok


def read_shard_header(path):
    """-> ntok, after checking that the file holds exactly that many tokens."""
    f, ntok = open_shard(path)
    f.close()
    return ntok


def read_shard(path):
    """-> the tokens as a read-only uint16 (ntok,) memory map: pages are read only when used."""
    ntok = read_shard_header(path)
    if ntok == 0:
        return np.zeros(0, dtype=np.uint16)   # mmap cannot map zero bytes
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(ntok,))


# ----------------------------------------------------------------------------------------------
# Eval file (HellaSwag style): multiple-choice examples as one uint16 stream
#
# Each example: EVAL_START, example_bytes (its whole length in bytes, these fields included),
# example_index, label, num_completions (4), ctx_len, ctx tokens, then 4 x (len, tokens).

def _encode_example(index, example):
    """One example as its list of uint16 values."""
    label, context, completions = example["label"], list(example["context"]), example["completions"]
    if len(completions) != EVAL_COMPLETIONS or not 0 <= label < EVAL_COMPLETIONS:
        raise ValueError(f"example {index}: expected {EVAL_COMPLETIONS} completions and a label "
                         f"0..{EVAL_COMPLETIONS - 1}, got {len(completions)} and {label}")
    body = [index, label, EVAL_COMPLETIONS, len(context), *context]
    for completion in completions:
        body += [len(completion), *completion]
    return [EVAL_START, 2 * (2 + len(body)), *body]


def write_eval(path, examples):
    """examples: list of dict(label=int, context=list of token ids, completions=4 lists of token ids)."""
    encoded = [_encode_example(i, example) for i, example in enumerate(examples)]
    stream = np.array([value for values in encoded for value in values], dtype=np.int64)
    if stream.size and not 0 <= stream.min() <= stream.max() <= 65535:
        raise FormatError(f"{path}: every token id, length and index must fit in uint16 (0..65535)")
    header = new_header(EVAL_MAGIC, EVAL_VERSION)
    header[2] = len(examples)
    header[3] = max((2 * len(values) for values in encoded), default=0)   # longest_example_bytes
    with atomic_write(path) as f:
        f.write(header.tobytes())
        _write_array(f, stream, "<u2")


def _decode_example(stream, pos, index, longest):
    """The example starting at stream[pos] -> (dict, position after it); ValueError says what is wrong."""
    # the five fixed fields, zero-padded so that a cut-off tail fails the checks below
    start, nbytes, got_index, label, ncomp = (stream[pos:pos + 5] + [0] * 5)[:5]
    if start != EVAL_START:
        raise ValueError(f"start marker {start}, expected {EVAL_START}")
    if nbytes > 2 * (len(stream) - pos):
        raise ValueError(f"truncated: the example says {nbytes} bytes, "
                         f"the file has {2 * (len(stream) - pos)} left")
    if nbytes > longest:
        raise ValueError(f"{nbytes} bytes, more than the header's longest example ({longest} bytes)")
    if got_index != index:
        raise ValueError(f"example_index {got_index}, expected {index}")
    if ncomp != EVAL_COMPLETIONS or not 0 <= label < EVAL_COMPLETIONS:
        raise ValueError(f"{ncomp} completions and label {label}, expected {EVAL_COMPLETIONS} and 0..3")
    end = pos + nbytes // 2
    fields, at = [], pos + 5
    for _ in range(1 + EVAL_COMPLETIONS):   # the context, then each completion: a length, then tokens
        if at >= end or at + 1 + stream[at] > end:
            raise ValueError(f"its lengths overrun its {nbytes} bytes")
        fields.append(stream[at + 1:at + 1 + stream[at]])
        at += 1 + stream[at]
    if 2 * (at - pos) != nbytes:
        raise ValueError(f"its fields take {2 * (at - pos)} bytes, but it says {nbytes}")
    return dict(label=label, context=fields[0], completions=fields[1:]), end


def read_eval(path):
    """-> list of dict(label, context, completions), checking markers, indices and lengths."""
    with open_llmc(path, EVAL_MAGIC, {EVAL_VERSION: ""}) as (f, header, payload_bytes):
        num_examples, longest = int(header[2]), int(header[3])
        check_counts(path, examples=num_examples, longest_example_bytes=longest)
        if payload_bytes % 2:
            raise FormatError(f"{path}: payload of {payload_bytes} bytes is not a whole number of uint16")
        stream = np.fromfile(f, dtype="<u2", count=payload_bytes // 2).tolist()
    examples, pos = [], 0
    for i in range(num_examples):
        if pos == len(stream):
            raise FormatError(f"{path}: truncated: header says {num_examples} examples but the file "
                              f"holds only {i}")
        try:
            example, pos = _decode_example(stream, pos, i, longest)
        except ValueError as e:
            raise FormatError(f"{path}: example {i} (at payload byte {2 * pos}): {e}") from None
        examples.append(example)
    if pos != len(stream):
        raise FormatError(f"{path}: file size disagrees with header: {num_examples} examples end at "
                          f"payload byte {2 * pos} but the file has {payload_bytes} bytes of payload "
                          f"({payload_bytes - 2 * pos} extra bytes)")
    return examples
