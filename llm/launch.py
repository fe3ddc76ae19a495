"""How this process was launched, and how it stops: one process, or one rank of a job that mpirun started.

  launched_world_size(), launched_rank(), local_ranks()   read from the launcher's environment
  configure_threads()        size BLAS's threads (and MPI's waiting) from the cores each local rank gets
  install_signal_handlers()  SIGINT (Ctrl-C) and SIGTERM end the run with one line, on every rank
  stop(message, code)        print one line and end this process and, under a launcher, the whole job
  Parser                     argparse for every command line here: a mistake in the options is one line

This module imports neither numpy nor mpi4py when it loads: configure_threads() must run before numpy is first
imported, because OpenBLAS reads its thread count once, when it loads.

Why a job has to be stopped as a whole: a rank that just exits leaves the others waiting forever in their
next collective (or in MPI's start-up), and a rank that raises an exception is in the same place, plus
mpi4py then calls MPI_Finalize at exit, which waits for the others. MPI_Abort ends every rank at once.
"""
import argparse
import os
import signal
import sys
import time

# the variables launchers set: Open MPI, MPICH's hydra, PMIx (Open MPI 5, Slurm), MVAPICH
WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
# every thread pool a BLAS (or OpenMP code under it) may start reads one of these
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")
# with more ranks than cores, MPI must give the core away while it waits: MPICH sleeps between idle polls,
# Open MPI yields
YIELD_VARS = {"MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}
RANK0_FIRST_S = 0.7   # how long other ranks let rank 0 speak first when every rank fails alike
FORWARD_S = 0.2       # how long a rank waits, once its line is out, for the launcher to pass it on before the abort


def _first_int(names, default):
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return default


def launched_world_size():
    """The number of processes mpirun/mpiexec started, read from the launcher's environment (1 if none)."""
    return _first_int(WORLD_SIZE_VARS, 1)


def launched_rank():
    return _first_int(RANK_VARS, 0)


def local_ranks():
    """How many ranks of this job share this machine (1 without a launcher)."""
    return _first_int(LOCAL_SIZE_VARS, 1)


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


def configure_threads():
    """Set the thread counts of BLAS and OpenMP to threads_per_rank(), unless the user set them, and, with
    more ranks than cores, make MPI yield the core while it waits instead of spinning. Call this before
    numpy (or mpi4py) is imported."""
    threads = str(threads_per_rank())
    for name in THREAD_VARS:
        os.environ.setdefault(name, threads)
    if local_ranks() > cores():
        for name, value in YIELD_VARS.items():
            os.environ.setdefault(name, value)


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
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(code)
    from mpi4py import MPI   # starts MPI, if this rank had not yet
    if rank > 0:
        time.sleep(RANK0_FIRST_S)
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    time.sleep(FORWARD_S)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    MPI.COMM_WORLD.Abort(code)


def _on_signal(signum, frame):
    # one line, once: a second Ctrl-C while this one is handled changes nothing
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    stop(f"stopped by {signal.Signals(signum).name}", 128 + signum)


def install_signal_handlers():
    """SIGINT and SIGTERM stop the run with one line and exit code 128 + the signal's number (130, 143),
    on every rank. A rank in the middle of a collective handles the signal when the collective returns."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)


class Parser(argparse.ArgumentParser):
    """argparse, but a wrong option or value prints one line, "error: ...", and exits with 1, as every
    other mistake does (argparse's own prints the usage first and exits with 2); --help shows the usage."""

    def error(self, message):
        print(f"error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(1)
