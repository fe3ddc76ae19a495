"""How a command runs and how it stops: one process, or one rank of a job that mpirun started.

  run(main)                  every command's entry point: threads, signals, and one rule for errors
  UserError, UsageError      what a person got wrong: one line, "error: ...", and exit status 1
  launched_world_size(), launched_rank(), local_ranks()   read from the launcher's environment
  limit_threads()            size BLAS's threads (and MPI's waiting) from the cores each local rank gets
  install_signal_handlers()  SIGINT, SIGTERM, SIGHUP, SIGUSR1 end the run with one line, on every rank
  worker_signals()           a forked worker leaves those to the command that started it
  Preemption                 SIGUSR1 in the trainer: finish the step, write a checkpoint, then stop
  stop(message, code)        print one line and end this process and, under a launcher, the whole job
  Parser                     argparse for every command line here: a mistake in the options is one line
  positive_int               Parser's type for an option that counts something (steps, repeats, a batch)
  output_dir, output_file    an output place that cannot be written is one line before any work, not after
  from_environment           the line for a bad path that came from an environment variable, not a flag
  file_problem, existing_folder   what is wrong with a path a command reads; the nearest folder that exists
  optional(module, extra)    import a package only some commands need, or say in one line how to install it
  install(extra)             the pip command that installs one of the optional extras

This module imports neither numpy nor mpi4py when it loads: every module of llm/ may import it, and MPI's
waiting must be set before mpi4py.MPI starts MPI.

Why a job has to be stopped as a whole: a rank that just exits leaves the others waiting forever in their
next collective (or in MPI's start-up), and a rank that raises an exception is in the same place, plus
mpi4py then calls MPI_Finalize at exit, which waits for the others. MPI_Abort ends every rank at once.
"""
import argparse
import errno
from functools import partial
import importlib
import os
import signal
import sys
import tempfile
import time
import traceback

# the variables launchers set: Open MPI, MPICH's hydra, PMIx (Open MPI 5, Slurm), MVAPICH
WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE",
                   "MV2_COMM_WORLD_LOCAL_SIZE")
# every thread pool a BLAS (or OpenMP code under it) may start reads one of these when it loads: one set by
# the user is kept
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
# with more ranks than cores, MPI must give the core away while it waits: MPICH sleeps between idle polls,
# Open MPI yields
YIELD_VARS = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}
RANK0_FIRST_S = 0.7   # how long other ranks let rank 0 speak first when every rank fails alike
FORWARD_S = 0.2       # how long a rank waits, once its line is out, for the launcher to pass it on


def _first_int(names, default, minimum=0):
    """The first of the variables `names` that holds a whole number of at least `minimum`; a value that
    is not one (a size of 0, left by another launcher) is not the launcher's, and is passed over."""
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) >= minimum:
            return int(value)
    return default


def launched_world_size():
    """The number of processes mpirun/mpiexec started, read from the launcher's environment (1 if none)."""
    return _first_int(WORLD_SIZE_VARS, 1, minimum=1)


def launched_rank():
    return _first_int(RANK_VARS, 0)


def local_ranks():
    """How many ranks of this job share this machine (1 without a launcher)."""
    return _first_int(LOCAL_SIZE_VARS, 1, minimum=1)


def cores():
    """The cores this process may run on (its affinity mask, which taskset and cgroup cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def threads_per_rank():
    """Threads each rank should compute on: its share of the machine's cores, at least one.

    Four ranks on two cores that each start a BLAS thread per core (and a pool thread per core) run
    sixteen busy threads on two cores, and a step takes many times longer than on one rank."""
    return max(1, cores() // local_ranks())


def limit_threads():
    """Size this process's BLAS and OpenMP thread pools to threads_per_rank(), unless the user set a thread
    count in the environment (BLAS read it when it loaded), and, with more ranks than cores, make MPI give
    the core away while it waits instead of spinning. threadpoolctl resizes the pools of the libraries
    loaded so far, so call this once numpy is imported, and before MPI starts (mpi4py.MPI's import)."""
    if local_ranks() > cores():
        for name, value in YIELD_VARS.items():
            os.environ.setdefault(name, value)
    if not any(name in os.environ for name in THREAD_VARS):
        from threadpoolctl import threadpool_limits
        threadpool_limits(threads_per_rank())


def stop(message, code=1):
    """Print `message` (one line; under a launcher prefixed with the rank) and end the run with `code`.

    One process exits through SystemExit, so that open files close and temporary files are removed.
    Under a launcher the whole job ends through MPI_Abort, started first if this rank had not started MPI
    yet: mpiexec (MPICH's hydra) leaves the other ranks running when one exits with an error code, and
    they would wait for it forever, in MPI's start-up or in a collective. When every rank fails alike (a
    bad flag, a bad file) the others give rank 0 RANK0_FIRST_S to abort the job, so the line prints once.
    The launcher forwards a rank's output through a pipe, and an abort can end the job before it has read
    the line: the rank waits FORWARD_S after printing it. MPICH's MPI_Abort then prints a line of its own
    ("Abort(1) on node 0 ...: application called MPI_Abort"), which says nothing more, so stderr goes to
    /dev/null first."""
    world_size, rank = launched_world_size(), launched_rank()
    if world_size == 1:
        _flush_stdout()
        _say(message)
        raise SystemExit(code)
    from mpi4py import MPI   # starts MPI, if this rank had not yet
    if rank > 0:
        time.sleep(RANK0_FIRST_S)
    _say(f"rank {rank}: {message}")
    _flush_stdout()
    time.sleep(FORWARD_S)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    MPI.COMM_WORLD.Abort(code)


def _say(line):
    """The line on stderr, if stderr is still there: a closed ssh session takes the terminal with it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _flush_stdout():
    """Flush stdout before the last line; if it cannot be written (its reader has gone, its disk is full),
    point it at /dev/null, so that Python's own flush at exit does not fail again."""
    try:
        sys.stdout.flush()
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _on_signal(signum, frame, why=""):
    # one line, once: a second Ctrl-C while this one is handled changes nothing
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    _stopping.append(128 + signum)
    stop(f"stopped by {signal.Signals(signum).name}{why}", 128 + signum)


# the exit code of the signal being handled: the SystemExit that stops a single process is raised wherever
# the signal found it, and some code turns it into another exception (Python 3.11 wraps any exception that
# a class body's __set_name__ raises, as in threadpoolctl's import, in a RuntimeError); run() exits with it
_stopping = []


# Ctrl-C, kill's default, a closed terminal or ssh session, and Slurm's warning before it ends a job
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def install_signal_handlers():
    """Each of SIGNALS stops the run with one line and exit code 128 + the signal's number (130, 143, 129,
    138), on every rank. A rank in the middle of a collective handles the signal when the collective
    returns."""
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def worker_signals():
    """In a worker process that a command forked (a multiprocessing pool): ignore Ctrl-C, a closed terminal
    and SIGUSR1, which the command itself reports in one line, and end quietly on SIGTERM, with which the
    pool ends its workers."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Preemption:
    """SIGUSR1, Slurm's warning before it ends a job (srun --signal=USR1@90): the trainer finishes its step,
    writes a checkpoint and stops, so that -y 1 resumes the job. With nothing to save (no -o), the signal
    stops the run at once, with a line that says why nothing was saved.

    The signal may reach some ranks and not others: requested(comm) is a collective that every rank calls
    at the same point of each step, and that tells them all whether any rank got it."""

    def __init__(self, can_save, why_not=""):
        self.can_save, self.signalled = can_save, False
        signal.signal(signal.SIGUSR1, self._remember if can_save else partial(_on_signal, why=why_not))

    def _remember(self, signum, frame):
        self.signalled = True

    def requested(self, comm):
        return self.can_save and comm.scalar_sum(self.signalled) > 0


class UserError(ValueError):
    """A mistake in what a person gave a command (a flag, a file, a size, a token id) or in what the
    machine offers it (a missing package, no GPU): run() prints it as one line, "error: ...", and exits
    with 1. Every such error class here derives from it; any other exception is a bug, and shows its
    traceback."""


class UsageError(UserError):
    """A mistake in the command line itself: the line ends by pointing at --help."""

    def __str__(self):
        return f"{super().__str__()} (--help lists the flags)"


class Parser(argparse.ArgumentParser):
    """argparse, but a wrong option or value is a UsageError, one line as every other mistake (argparse's own
    prints the usage first and exits with 2); --help shows the usage, under the command as it was typed
    (python -m llm.sample, python test_gpt2.py)."""

    def __init__(self, **kwargs):
        spec = getattr(sys.modules["__main__"], "__spec__", None)   # set when run as python -m MODULE
        command = f"-m {spec.name}" if spec else os.path.basename(sys.argv[0])
        super().__init__(prog=f"python {command}", **kwargs)

    def error(self, message):
        raise UsageError(message)


def positive_int(text):
    """An argparse type: a whole number of 1 or more, where 0 or less would divide by zero or time nothing."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"needs a whole number, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def from_environment(path, variable, flag, problem):
    """The line for a bad path that a command took from $variable, where `flag` was not given: it names the
    variable, which the user may have set long ago, and says to fix or unset it."""
    return f"{path} (${variable}): {problem}: fix or unset {variable}, or pass {flag} PATH"


def file_problem(path):
    """Why `path` is no file this process can read, in a few words ("no such file"), or None."""
    if os.path.isfile(path) and os.access(path, os.R_OK):
        return None
    return ("a folder, not a file" if os.path.isdir(path) else "not a readable file" if os.path.exists(path)
            else "no such file")


def existing_folder(path):
    """The nearest of `path` and its parents that exists (a folder, unless a part of the path is a file)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def output_dir(path, flag="--out"):
    """Check that `path` is a folder this process can write into, or can make and write into, or raise a
    UserError naming `flag`. Called before any work, so that an output that cannot be written is one line
    at once, not an error after the work, which names a temporary file; it writes nothing, so a command
    that then fails leaves nothing behind. Returns path."""
    if not path:
        raise UserError(f"{flag} is empty: name a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{flag} {path}: exists and is not a folder: name a folder")
    return _writable(path, path, flag)


def output_file(path, flag):
    """output_dir for the folder of the file `path`, which must not be a folder itself. Returns path."""
    if not path:
        raise UserError(f"{flag} is empty: name a file")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a folder: name a file")
    return _writable(path, os.path.dirname(os.path.abspath(path)), flag)


def _writable(path, folder, flag):
    existing = existing_folder(folder)   # it will hold the folders the command makes
    if not os.path.isdir(existing):
        raise UserError(f"{flag} {path}: a part of the path is a file, not a folder: choose another place")
    try:
        with tempfile.TemporaryFile(dir=existing):   # made and removed: what the command will do there
            pass
    except OSError as e:
        problem = e.strerror or e
        raise UserError(f"{flag} {path}: cannot write there ({problem}): choose another place") from None
    return path


class StdoutError(OSError):
    """stdout cannot be written: its reader has gone (a closed pipe, `| head`) or its disk is full."""


class _Stdout:
    """sys.stdout, whose write errors are StdoutErrors: a failed write to stdout and one to a data file are
    both an OSError without a file name, and only stdout's means that nothing more can be printed."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None


def install(extra):
    """The command that installs one of pyproject.toml's optional extras (gpu, cudnn, weights, data, plot)."""
    return f'pip install -e ".[{extra}]"'


def optional(module, extra):
    """Import `module` from a package that only some commands need, one of the optional `extra`'s, which
    `import llm` never needs. Without it, a UserError: one line that names the package and the command
    that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"this needs the {module.split('.')[0]} package: {install(extra)}") from None


def run(main, memory_advice="use a machine with more memory"):
    """Run a command's main(argv), as every command here runs (python train_gpt2.py, python -m llm.sample,
    python -m data.tinyshakespeare, ...), and exit with what it returns (None: 0).

    Its threads are sized (limit_threads) and its signals handled (install_signal_handlers) first. Then
    a UserError is one line, "error: ...", and exit status 1; an OSError (a disk that fills, a file that
    cannot be opened) is one line too; stdout that cannot be written is one line on stderr: a reader that
    has gone (`| head`, exit 141, as SIGPIPE's) or a full disk (`> /dev/full`, exit 1). An allocator's
    MemoryError (NumPy's; CuPy's OutOfMemoryError is one) is one line with the command's memory_advice:
    where a command counts its memory first (llm/memory.py), the count missed something. Any other
    exception is a bug: its traceback, and under a launcher every rank stops."""
    install_signal_handlers()
    sys.stdout = _Stdout(sys.stdout)
    try:
        limit_threads()
        code = main(sys.argv[1:])
        sys.stdout.flush()   # the last of stdout goes out here, where a failure is reported, not at exit
    except StdoutError as e:
        if e.errno == errno.EPIPE:
            stop("stopped: the reader of stdout has gone (broken pipe)", 128 + signal.SIGPIPE)
        stop(f"error: cannot write stdout ({e.strerror})")
    except UserError as e:
        stop(f"error: {e}")
    except MemoryError as e:
        stop(f"error: out of memory ({str(e).splitlines()[0] if str(e) else 'the allocator said no more'}): "
             f"{memory_advice}")
    except OSError as e:
        stop(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e.strerror or e}")
    except Exception:
        if _stopping:   # a signal's SystemExit in another guise: its line is out
            raise SystemExit(_stopping[0]) from None
        stop(traceback.format_exc().rstrip())   # a bug: its traceback is the report; every rank stops
    raise SystemExit(code or 0)
