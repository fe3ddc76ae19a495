"""Ranks check each other at start-up: every rank of a job must run the same run.

mpirun gives every rank the same command line, but an MPMD launch (mpiexec -n 1 A : -n 1 B), a wrapper
script, or nodes whose files differ can start ranks that disagree, and they would not notice: a different
-b prints wrong losses, a different -x leaves a rank waiting forever in a collective that the others never
enter, a different -e ends in MPI's error stack, a different shard trains on other data. So once the flags
are parsed and the model and the data are open, each rank describes what it runs (digest), the ranks
compare, and at the first difference every rank stops with the same line, naming the flag or file.
(What a resume loads is agreed on later, in llm/checkpoint.py: rank 0 chooses, the others confirm.)
"""
import os

import xxhash

from llm import formats
from llm.launch import UserError


class RanksDisagree(UserError):
    """Ranks of one job started with different flags, files or models: one line naming the first."""


def check(comm, flags, settings, model, loaders):
    """Every rank calls this once its model and loaders are built: RanksDisagree (one line, the same on every
    rank) unless every rank's digest is rank 0's."""
    compare(comm, digest(flags, settings, model, loaders))


def digest(flags, settings, model, loaders):
    """What this rank runs, as {what: how it is here}, in the order a difference is reported: every flag
    (flags maps each one to its Settings field first, as train_gpt2.py's FLAGS), the backend, the model
    file, every file the loaders read (the shards, the eval file; None for a loader not built) and the
    model's config."""
    run = {}
    for flag, (name, *_) in flags.items():
        value = getattr(settings, name)
        run[flag] = "not given" if value is None else str(value)
    run["the backend"] = f"{model.backend.name} in {model.backend.precision}"
    source = settings.load_filename
    if source.endswith(".bin"):   # its bytes, by the checksum it records (llm.c's files: by their size)
        checksum, size = formats.model_checksum(source), os.path.getsize(source)
        run[source] = f"{size:,} bytes" + (f", checksum {checksum:016x}" if checksum else "")
    for loader in filter(None, loaders):
        run.update(loader.files())
    run["the model"] = str(model.config)
    return run


def compare(comm, run):
    """RanksDisagree, naming the first thing that differs, when any rank's digest is not rank 0's. The ranks
    first compare a hash of their digests, so that a job of many ranks over many shards sends 8 bytes a
    rank, and the digests themselves only when the hashes differ."""
    mine = xxhash.xxh3_64(repr(list(run.items())).encode()).intdigest()
    if len(set(comm.all_gather_object(mine))) == 1:
        return
    runs = comm.all_gather_object(run)
    for what in dict.fromkeys(key for r in runs for key in r):   # rank 0's order, then what only others have
        here = runs[0].get(what, "no such file")
        for rank, other in enumerate(runs[1:], 1):
            there = other.get(what, "no such file")
            if there != here:
                raise RanksDisagree(f"ranks disagree on {what}: {here} on rank 0 but {there} on rank {rank}: "
                                    f"every rank must run with the same flags and see the same files")
