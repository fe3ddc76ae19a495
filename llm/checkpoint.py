"""The output directory (-o) of a run: checkpoints as llm.c lays them out, main.log, and resuming.

  DIR/model_%08d.bin   the parameters, llm.c's model file (v3 fp32 or v5 bf16), readable by llm.c
  DIR/state_%08d.bin   optimizer state (full m, v, master), step, data position, outlier windows
  DIR/DONE_%08d        written last: a checkpoint counts only once its DONE file exists
  DIR/main.log         llm.c's log lines (s:STEP trl:... / tel:... / eval:...)
  DIR/LOCK             locked (flock) by the run writing here, for as long as it runs

llm.c writes one state file per rank holding that rank's shard. We gather the shards and rank 0 writes
one state file with the full buffers, so a run can resume with a different number of processes.
Every file is written to a temporary name, synced and renamed (formats.atomic_write), so a run killed
at any moment leaves either a complete checkpoint or one without DONE, which resume ignores.

When a run starts, OutputDir enforces three rules, so that no run mixes its files with another's:
  - one run at a time: LOCK is held by the writing run (the kernel lets it go when that process ends,
    even by kill -9), and a second run refuses to start;
  - a fresh run (no -y 1) refuses a directory that holds checkpoints: they belong to an earlier run, and
    a later -y 1 would resume that run. Nothing is deleted: resume it, or choose another -o;
  - temporary files that a killed write left behind are removed.
"""
from contextlib import contextmanager, suppress
import fcntl
import os
import re
import socket

from . import formats
from .launch import UserError

CHECKPOINT_FILE = re.compile(r"(?:model_|state_|DONE_)(\d{8})(?:\.bin)?")


class CheckpointError(UserError):
    """An output directory that cannot be used, or a checkpoint that cannot be written or resumed: one line."""


def model_path(out_dir, step):
    return os.path.join(out_dir, f"model_{step:08d}.bin")


def state_path(out_dir, step):
    return os.path.join(out_dir, f"state_{step:08d}.bin")


def done_path(out_dir, step):
    return os.path.join(out_dir, f"DONE_{step:08d}")


def latest_step(out_dir):
    """The largest step with a DONE file in out_dir, or None."""
    if not os.path.isdir(out_dir):
        return None
    steps = [int(m.group(1)) for f in os.listdir(out_dir) if (m := re.fullmatch(r"DONE_(\d{8})", f))]
    return max(steps, default=None)


def save(out_dir, step, model, optimizer, loader, guard, comm):
    """Write model, state and DONE for `step`. Every rank calls this (the optimizer state is gathered).

    Raises CheckpointError on rank 0 when the parameters are not finite (nothing is written) or a file
    cannot be written (the files of this step are removed); the checkpoints before it stay as they were."""
    m, v, master = optimizer.full_state()
    params = model.params_numpy()
    if comm.rank == 0:
        if not formats.all_finite(params):
            raise CheckpointError(f"the parameters hold NaN or inf at step {step}: no checkpoint written "
                                  f"({_newest(out_dir)})")
        version = 5 if model.backend.precision == "bf16" else 3
        with _writing(out_dir, step):
            print(f"Writing model to {model_path(out_dir, step)}")
            formats.write_model(model_path(out_dir, step), model.config, params, version=version)
            print(f"Writing state to {state_path(out_dir, step)}")
            formats.write_state(state_path(out_dir, step), step=step, num_processes=comm.world_size,
                                rng_state=0,  # training draws no random numbers: nothing to restore
                                loader_state=loader.state(), m=m, v=v, master=master,
                                should_shuffle=loader.shuffle, samples_per_epoch=loader.num_samples,
                                seq_len=loader.T, **guard.state())
    comm.barrier()
    if comm.rank == 0:
        with _writing(out_dir, step), formats.atomic_write(done_path(out_dir, step)):
            pass
    comm.barrier()


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
    return "no earlier checkpoint" if step is None else f"the checkpoint at step {step} is intact: -y 1 resumes it"


def delete(out_dir, step):
    """Remove a checkpoint, DONE first so that it stops counting before its files go; missing files are fine."""
    for path in (done_path(out_dir, step), model_path(out_dir, step), state_path(out_dir, step)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _problem(e):
    """An OSError in a few words: 'No space left on device', with the file when it is known."""
    return f"{e.filename}: {e.strerror}" if e.filename else e.strerror


def load(out_dir, step, model, optimizer, loader, guard):
    """Restore parameters, optimizer state, data position and outlier windows from the checkpoint at `step`.

    Raises formats.FormatError if a file is damaged or its model differs from the one this run builds,
    and CheckpointError if the saved data position means something else in this run (another -t, -a
    or train data): resuming would skip or repeat data, so we refuse rather than guess."""
    config, params, _ = formats.read_model(model_path(out_dir, step))
    if config != model.config:
        raise formats.FormatError(f"{model_path(out_dir, step)}: checkpoint model {config} differs from the "
                                  f"model given by -e, {model.config}")
    path = state_path(out_dir, step)
    state = formats.read_state(path, model.config.num_parameters)
    if state["step"] != step:
        raise formats.FormatError(f"{path}: holds the state of step {state['step']}, not of step {step} as its "
                                  f"name says: the file is damaged")
    _check_data_position(path, state, loader)
    try:
        guard.load_state(state["loss_window"], state["norm_window"], state["nonfinite_streak"])
        loader.set_state(state["loader_state"])
    except ValueError as e:   # a window longer than a detector holds, a data position outside the data
        raise formats.FormatError(f"{path}: {e}") from None
    model.load_params(params)
    optimizer.load_full_state(state["m"], state["v"], state["master"])
    return step


def _check_data_position(path, state, loader):
    """The saved position counts samples of T+1 tokens in one shuffled (or not) train set: all must match.
    (Files from before seq_len and samples_per_epoch were recorded hold 0 there and are not checked.)"""
    if state["seq_len"] and state["seq_len"] != loader.T:
        raise CheckpointError(f"{path}: written with -t {state['seq_len']}, and this run has -t {loader.T}: the "
                              f"saved data position counts samples of T+1 tokens, so resume with "
                              f"-t {state['seq_len']}")
    if state["should_shuffle"] != loader.shuffle:
        raise CheckpointError(f"{path}: written with -a {int(not state['should_shuffle'])}, and this run has "
                              f"-a {int(not loader.shuffle)}: resume with the same -a")
    if state["samples_per_epoch"] and state["samples_per_epoch"] != loader.num_samples:
        raise CheckpointError(f"{path}: written over train data of {state['samples_per_epoch']} samples per epoch, "
                              f"and '{loader.pattern}' has {loader.num_samples}: the saved data position would "
                              f"point elsewhere, so resume with the same -i files")


class OutputDir:
    """The -o directory of one run, prepared by rank 0 as the module docstring says; no-ops when path is
    None (no -o). Every rank constructs it: the others wait until rank 0 has checked the directory.

    resume: -y 1, continue from the newest complete checkpoint (or start fresh if there is none)."""

    def __init__(self, path, resume, comm):
        self.path, self.rank, self._lock = path, comm.rank, None
        self.log_path = os.path.join(path, "main.log") if path else None
        if path and comm.rank == 0:
            try:
                self._prepare(resume)
            except OSError as e:
                raise CheckpointError(f"-o {path}: cannot use it ({_problem(e)})") from None
        comm.barrier()

    def _prepare(self, resume):
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointError(f"-o {self.path}: exists and is not a directory")
        os.makedirs(self.path, exist_ok=True)
        self._take_lock()
        steps = [int(m.group(1)) for name in os.listdir(self.path) if (m := CHECKPOINT_FILE.fullmatch(name))]
        if steps and not resume:
            raise CheckpointError(f"-o {self.path} holds checkpoints of an earlier run (the newest at step "
                                  f"{max(steps)}): use -y 1 to resume, or another -o")
        for name in os.listdir(self.path):
            if formats.is_temporary(name):
                os.remove(os.path.join(self.path, name))
        if not resume:
            open(self.log_path, "w").close()

    def _take_lock(self):
        """Lock DIR/LOCK for as long as this process lives, and write who holds it there."""
        fd = os.open(os.path.join(self.path, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
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

    def resume(self, model, optimizer, loader, guard):
        """Load the newest complete checkpoint; -> its step, or 0 when there is none."""
        step = latest_step(self.path) if self.path else None
        return 0 if step is None else load(self.path, step, model, optimizer, loader, guard)

    def log(self, line):
        """Append one line to main.log (rank 0 writes it)."""
        if not self.path or self.rank != 0:
            return
        try:
            with open(self.log_path, "a") as f:
                f.write(line + "\n")
        except OSError as e:
            raise CheckpointError(f"cannot write {self.log_path} ({e.strerror}); "
                                  f"{_newest(self.path)}") from None

    def save(self, step, model, optimizer, loader, guard, comm, keep=0, keep_every=0, every=1):
        """Write the checkpoint at `step`, then delete the one `keep` checkpoints back (-nk; 0 keeps all)
        unless its step is a multiple of keep_every (-nm). Checkpoints are `every` (-n) steps apart."""
        save(self.path, step, model, optimizer, loader, guard, comm)
        old = step - keep * every
        if comm.rank == 0 and keep > 0 and old > 0 and (keep_every == 0 or old % keep_every):
            try:
                delete(self.path, old)
            except OSError as e:
                raise CheckpointError(f"cannot delete the checkpoint at step {old} ({_problem(e)})") from None
