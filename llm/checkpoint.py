"""The output directory (-o) of a run: checkpoints as llm.c lays them out, main.log, and resuming.

  DIR/model_%08d.bin   the parameters, llm.c's model file (v3 fp32 or v5 bf16), readable by llm.c
  DIR/state_%08d.bin   optimizer state (full m, v, master), step, data position, outlier windows
  DIR/DONE_%08d        written last: a checkpoint counts only once its DONE file exists
  DIR/main.log         llm.c's log lines (s:STEP trl:... / tel:... / eval:...), one of each kind a step
  DIR/LOCK             locked (flock) by the run writing here, for as long as it runs

llm.c writes one state file per rank holding that rank's shard. We gather the shards and rank 0 writes
one state file with the full buffers, so a run can resume with a different number of processes.
Every file is written to a temporary name, synced and renamed (formats.atomic_write), so a run killed
at any moment leaves either a complete checkpoint or one without DONE, which resume ignores.

A checkpoint proves its own bytes: the model and state files record their checksums and the run id
(formats.py, "Checksums"), and the state also records its model file's checksum. Resuming verifies all
three, so a bit flipped on disk, a zero-filled file, or a model file of another step or run is found;
rank 0 then falls back to the newest intact checkpoint, and says which and why in one line. Every other
rank loads the checkpoint rank 0 chose and confirms it read the same bytes, or every rank stops with one
line naming the file (a rank that does not see -o would otherwise start from step 0 and hang the job).

When a run starts, OutputDir enforces these rules, so that no run mixes its files with another's:
  - one run at a time: LOCK is held by the writing run (the kernel lets it go when that process ends,
    even by kill -9), and a second run refuses to start. Before each write the run checks that LOCK is
    still the file it locked: if someone deleted it, another run could have taken a new one, so this
    run stops rather than write beside it;
  - a fresh run (no -y 1) refuses a directory that holds checkpoints or a non-empty main.log: they belong
    to an earlier run, and a later -y 1 would resume that run. Nothing is deleted or truncated: resume
    it, or choose another -o;
  - the temporary files of checkpoint writes that a killed run left behind are removed (only names this
    module makes: model_, state_ or DONE_ with the step, then .<pid>.tmp).
"""
from contextlib import contextmanager, suppress
import fcntl
import os
import re
import secrets
import socket

from . import formats
from .launch import UserError, output_dir

# the names of a checkpoint's files, and the temporary names formats.atomic_write gives them
CHECKPOINT_FILE = re.compile(r"(?:model_|state_)(\d{8})\.bin|DONE_(\d{8})")
TEMPORARY_FILE = re.compile(rf"(?:{CHECKPOINT_FILE.pattern})\.\d+\.tmp")


class CheckpointError(UserError):
    """An output directory that cannot be used, or a checkpoint that cannot be written or resumed: one
    line."""


def model_path(out_dir, step):
    return os.path.join(out_dir, f"model_{step:08d}.bin")


def state_path(out_dir, step):
    return os.path.join(out_dir, f"state_{step:08d}.bin")


def done_path(out_dir, step):
    return os.path.join(out_dir, f"DONE_{step:08d}")


def done_steps(out_dir):
    """The steps with a DONE file in out_dir, oldest first: the checkpoints that count."""
    if not os.path.isdir(out_dir):
        return []
    names = (CHECKPOINT_FILE.fullmatch(name) for name in os.listdir(out_dir))
    return sorted(int(m.group(2)) for m in names if m and m.group(2))


def latest_step(out_dir):
    """The largest step with a DONE file in out_dir, or None."""
    return max(done_steps(out_dir), default=None)


def find_model(path):
    """-e MODEL: a model file is itself; a run's directory (ours or llm.c's) gives the model file of its
    newest complete checkpoint, the one -y 1 would resume."""
    if not os.path.isdir(path):
        return path
    step = latest_step(path)
    if step is None:
        raise CheckpointError(f"{path}: a directory without a complete checkpoint (no DONE_%08d file): "
                              f"pass a model .bin, or a run's -o directory")
    return model_path(path, step)


@contextmanager
def _writing(out_dir, step):
    """An OSError while the checkpoint at `step` is written (a full disk, a file in the way) becomes one line,
    once the files of this step are removed: the checkpoints before it are left as they were."""
    try:
        yield
    except OSError as e:
        for path in (model_path(out_dir, step), state_path(out_dir, step)):
            with suppress(OSError):
                os.remove(path)
        raise CheckpointError(f"cannot write the checkpoint at step {step} in {out_dir} ({_problem(e)}); "
                              f"{_newest(out_dir)}") from None


def _newest(out_dir):
    """What a user can still resume from, for error messages."""
    step = latest_step(out_dir)
    if step is None:
        return "no earlier checkpoint"
    return f"the checkpoint at step {step} is intact: -y 1 resumes it"


def delete(out_dir, step):
    """Remove a checkpoint, DONE first so that it stops counting before its files go; missing files are
    fine."""
    for path in (done_path(out_dir, step), model_path(out_dir, step), state_path(out_dir, step)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _problem(e):
    """An OSError in a few words: 'No space left on device', with the file when it is known."""
    return f"{e.filename}: {e.strerror}" if e.filename else e.strerror


def load(out_dir, step, model, optimizer, loader, guard):
    """Restore parameters, optimizer state, data position and outlier windows from the checkpoint at `step`;
    -> (run id, fingerprint): the run that wrote it, and {path: (size, checksum)} of its two files.

    Raises formats.FormatError if a file is damaged (it does not match its checksum, holds values no run
    makes, or its model file is not the one its state was saved with), and CheckpointError if the
    checkpoint is fine but not for this run: a model other than -e's, or a data position that means
    something else here (another -t, -a or train data), which would skip or repeat data."""
    path = model_path(out_dir, step)
    config, params, _ = formats.read_model(path)   # verifies the model file's own checksum
    if config != model.config:
        raise CheckpointError(f"{path}: holds a {config} model, but -e gives {model.config}: resume with "
                              f"the -e the run was started with")
    model_checksum = formats.model_checksum(path)
    path = state_path(out_dir, step)
    state = formats.read_state(path, model.config.num_parameters)
    if state["step"] != step:
        raise formats.FormatError(f"{path}: holds the state of step {state['step']}, not of step {step} "
                                  f"as its name says: the file is damaged")
    if state["model_checksum"] not in (None, model_checksum):   # None: a state from before checksums
        raise formats.FormatError(f"{model_path(out_dir, step)}: not the model file saved with {path} (the "
                                  f"state records checksum {state['model_checksum']:016x}, the model "
                                  f"{model_checksum or 0:016x}): a model of another step or run")
    _check_data_position(path, state, loader)
    try:
        guard.load_state(state["loss_window"], state["norm_window"], state["nonfinite_streak"])
        loader.set_state(state["loader_state"])
    except ValueError as e:   # a window longer than a detector holds, a data position outside the data
        raise formats.FormatError(f"{path}: {e}") from None
    model.load_params(params)
    optimizer.load_full_state(state["m"], state["v"], state["master"])
    fingerprint = {model_path(out_dir, step): (os.path.getsize(model_path(out_dir, step)), model_checksum),
                   path: (os.path.getsize(path), state["checksum"])}
    return state["run_id"], fingerprint


def _check_data_position(path, state, loader):
    """The saved position counts samples of T+1 tokens in one shuffled (or not) train set: all must match.
    (Files from before seq_len and samples_per_epoch were recorded hold 0 there and are not checked.)"""
    if state["seq_len"] and state["seq_len"] != loader.T:
        raise CheckpointError(f"{path}: written with -t {state['seq_len']}, and this run has -t {loader.T}: "
                              f"the saved data position counts samples of T+1 tokens, so resume with "
                              f"-t {state['seq_len']}")
    if state["should_shuffle"] != loader.shuffle:
        raise CheckpointError(f"{path}: written with -a {int(not state['should_shuffle'])}, and this run "
                              f"has -a {int(not loader.shuffle)}: resume with the same -a")
    if state["samples_per_epoch"] and state["samples_per_epoch"] != loader.num_samples:
        raise CheckpointError(f"{path}: written over train data of {state['samples_per_epoch']} samples "
                              f"per epoch, and '{loader.pattern}' has {loader.num_samples}: the saved data "
                              f"position would point elsewhere, so resume with the same -i files")


class OutputDir:
    """The -o directory of one run, prepared by rank 0 as the module docstring says; no-ops when path is
    None (no -o). Every rank constructs it: the others wait until rank 0 has checked the directory.

    resume: -y 1, continue from the newest intact checkpoint (or start fresh if there is none)."""

    def __init__(self, path, resume, comm):
        self.path, self.comm, self._lock = path, comm, None
        self.logged = set()   # (step, kind) of the lines main.log holds from before a resume
        self.log_path = os.path.join(path, "main.log") if path else None
        self.lock_path = os.path.join(path, "LOCK") if path else None
        self.run_id = secrets.randbits(64) or 1   # a resumed run takes its checkpoint's
        if path and comm.rank == 0:
            try:
                self._prepare(resume)
            except OSError as e:
                raise CheckpointError(f"-o {path}: cannot use it ({_problem(e)})") from None
        comm.barrier()

    def _prepare(self, resume):
        os.makedirs(output_dir(self.path, "-o"), exist_ok=True)
        self._take_lock()
        names = os.listdir(self.path)
        steps = [int(m.group(1) or m.group(2)) for name in names if (m := CHECKPOINT_FILE.fullmatch(name))]
        if steps and not resume:
            raise CheckpointError(f"-o {self.path} holds checkpoints of an earlier run (the newest at step "
                                  f"{max(steps)}): use -y 1 to resume, or another -o")
        if not resume and os.path.isfile(self.log_path) and os.path.getsize(self.log_path):
            raise CheckpointError(f"-o {self.path} holds the main.log of an earlier run: use -y 1 to go on "
                                  f"with it (its lines are kept), or another -o")
        for name in names:
            if TEMPORARY_FILE.fullmatch(name):
                os.remove(os.path.join(self.path, name))

    def _take_lock(self):
        """Lock DIR/LOCK for as long as this process lives, and write who holds it there."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another run"
            os.close(fd)
            raise CheckpointError(f"-o {self.path}: {holder} is writing there: wait for it to end, "
                                  f"or use another -o") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"the run of pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._lock = fd

    def _check_lock(self):
        """Before rank 0 writes: DIR/LOCK must still be the file this run locked. Deleted (or replaced),
        it no longer keeps a second run out, and that run may already write here: stop, and write nothing."""
        held = os.fstat(self._lock)
        try:
            now = os.stat(self.lock_path)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            what = "deleted" if now is None else "replaced"
            raise CheckpointError(f"-o {self.path}: {self.lock_path} was {what} while this run held it, so "
                                  f"another run may write there: stopping before writing more; "
                                  f"{_newest(self.path)}")

    def resume(self, model, optimizer, loader, guard):
        """Load the newest intact checkpoint; -> its step, or 0 when there is none.

        Rank 0 chooses it, skipping damaged ones; every other rank loads the one it chose and confirms
        that it read the same bytes. A rank that cannot, or read others, stops every rank with one line."""
        if not self.path:
            return 0
        step, run_id, fingerprint = 0, 0, None
        if self.comm.rank == 0:
            step, run_id, fingerprint = self._choose(model, optimizer, loader, guard)
        step, fingerprint = self.comm.broadcast_object((step, fingerprint))
        problem = None
        if step and self.comm.rank > 0:
            try:
                run_id, mine = load(self.path, step, model, optimizer, loader, guard)
                problem = next((_differs(path, mine[path], theirs) for path, theirs in fingerprint.items()
                                if mine[path] != theirs), None)
            except (formats.FormatError, CheckpointError) as e:
                problem = str(e)
        for rank, problem in enumerate(self.comm.all_gather_object(problem)):
            if problem:
                raise CheckpointError(f"rank {rank} cannot resume the checkpoint at step {step} as rank 0 "
                                      f"does ({problem}): every rank must see the same -o {self.path}")
        if run_id:
            self.run_id = run_id
        if step and self.comm.rank == 0 and os.path.isfile(self.log_path):
            with open(self.log_path, errors="replace") as f:   # a damaged byte costs its line alone
                self.logged = {log_key(line) for line in f}
        return step

    def _choose(self, model, optimizer, loader, guard):
        """Rank 0: load the newest checkpoint that is intact -> (step, run id, fingerprint), or (0, 0, None)
        when there is none. Each damaged one skipped gets a line; if all are damaged, the newest's error."""
        damaged = []
        for step in reversed(done_steps(self.path)):
            try:
                found = step, *load(self.path, step, model, optimizer, loader, guard)
            except formats.FormatError as e:
                damaged.append((step, e))
                continue
            for old, e in damaged:
                print(f"WARNING: skipping the damaged checkpoint at step {old}, resuming from step {step}: "
                      f"{e}")
            return found
        if damaged:
            others = f"; the {len(damaged) - 1} earlier checkpoint(s) are damaged too" if damaged[1:] else ""
            raise formats.FormatError(f"{damaged[0][1]}{others}: no checkpoint here can be resumed; restore "
                                      f"the files, or train anew with another -o")
        return 0, 0, None

    def log(self, line):
        """Append one line to main.log (rank 0 writes it), unless the run resumed from holds that step's line
        of that kind already: a resumed run measures the val loss of the step it resumes from again, and
        redoes the steps its checkpoint is behind a crash, with the same values."""
        if not self.path or self.comm.rank != 0 or log_key(line) in self.logged:
            return
        self._check_lock()
        try:
            with open(self.log_path, "a") as f:
                f.write(line + "\n")
        except OSError as e:
            raise CheckpointError(f"cannot write {self.log_path} ({e.strerror}); "
                                  f"{_newest(self.path)}") from None

    def save(self, step, model, optimizer, loader, guard, comm, keep=0, keep_every=0):
        """Write model, state and DONE for `step`, then delete all but the newest `keep` checkpoints up to it
        (-nk; 0 keeps all), except those whose step is a multiple of keep_every (-nm). Every rank calls this
        (the optimizer state is gathered); rank 0 writes.

        Raises CheckpointError on rank 0 when the parameters are not finite (nothing is written), when the
        lock was lost, or when a file cannot be written (the files of this step are removed); the
        checkpoints before it stay as they were."""
        m, v, master = optimizer.full_state()
        params = model.params_numpy()
        if comm.rank == 0:
            if not formats.all_finite(params):
                raise CheckpointError(f"the parameters hold NaN or inf at step {step}: no checkpoint written "
                                      f"({_newest(self.path)})")
            self._check_lock()
            version = 5 if model.backend.precision == "bf16" else 3
            with _writing(self.path, step):
                delete(self.path, step)   # a damaged checkpoint a fallback left at this step stops counting
                print(f"Writing model to {model_path(self.path, step)}")
                checksum = formats.write_model(model_path(self.path, step), model.config, params,
                                               version=version, run_id=self.run_id)
                print(f"Writing state to {state_path(self.path, step)}")
                formats.write_state(state_path(self.path, step), step=step, num_processes=comm.world_size,
                                    rng_state=0,  # training draws no random numbers: nothing to restore
                                    loader_state=loader.state(), m=m, v=v, master=master,
                                    should_shuffle=loader.shuffle, samples_per_epoch=loader.num_samples,
                                    seq_len=loader.T, model_checksum=checksum, run_id=self.run_id,
                                    **guard.state())
        comm.barrier()
        if comm.rank == 0:
            self._check_lock()   # lost while writing: the files may be paired with another run's, so no DONE
            with _writing(self.path, step), formats.atomic_write(done_path(self.path, step)):
                pass
            if keep > 0:
                self._delete_all_but(step, keep, keep_every)
        comm.barrier()

    def _delete_all_but(self, step, keep, keep_every):
        """Delete the checkpoints up to `step` but the newest `keep`, sparing multiples of keep_every.
        Those past `step` are left alone: damaged ones that a fallback skipped, which this run overwrites."""
        for old in [s for s in done_steps(self.path) if s <= step][:-keep]:
            if keep_every == 0 or old % keep_every:
                try:
                    delete(self.path, old)
                except OSError as e:
                    raise CheckpointError(f"cannot delete the checkpoint at step {old} "
                                          f"({_problem(e)})") from None


def log_key(line):
    """A main.log line's step and kind: "s:20 tel:5.5400" -> ("s:20", "tel")."""
    step, _, value = line.strip().partition(" ")
    return step, value.partition(":")[0]


def _differs(path, mine, theirs):
    """What differs between this rank's (size, checksum) of a file and rank 0's, in words."""
    def say(fingerprint):
        size, checksum = fingerprint
        return f"{size} bytes" + (f", checksum {checksum:016x}" if checksum else "")
    return f"{path}: {say(mine)} here, {say(theirs)} on rank 0"
