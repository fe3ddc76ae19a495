"""Checkpoints in an output directory, as llm.c lays them out, and resuming from the newest complete one.

  DIR/model_%08d.bin   the parameters, llm.c's model file (v3 fp32 or v5 bf16), readable by llm.c
  DIR/state_%08d.bin   optimizer state (full m, v, master), step and data position
  DIR/DONE_%08d        written last: a checkpoint counts only once its DONE file exists

llm.c writes one state file per rank holding that rank's shard. We gather the shards and rank 0 writes
one state file with the full buffers, so a run can resume with a different number of processes.
Every file is written to a temporary name, synced and renamed (formats.atomic_write), so a run killed
at any moment leaves either a complete checkpoint or one without DONE, which resume ignores.
"""
import os
import re

from . import formats


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


def save(out_dir, step, model, optimizer, loader, comm):
    """Write model, state and DONE for `step`. Every rank calls this (the optimizer state is gathered)."""
    m, v, master = optimizer.full_state()
    params = model.params_numpy()
    if comm.rank == 0:
        version = 5 if model.backend.precision == "bf16" else 3
        print(f"Writing model to {model_path(out_dir, step)}")
        formats.write_model(model_path(out_dir, step), model.config, params, version=version)
        print(f"Writing state to {state_path(out_dir, step)}")
        formats.write_state(state_path(out_dir, step), step=step, num_processes=comm.world_size,
                            rng_state=0,  # training draws no random numbers: nothing to restore
                            loader_state=loader.state(), m=m, v=v, master=master,
                            should_shuffle=loader.shuffle)
    comm.barrier()
    if comm.rank == 0:
        with formats.atomic_write(done_path(out_dir, step)):
            pass
    comm.barrier()


def delete(out_dir, step):
    """Remove a checkpoint, DONE first so that it stops counting before its files go."""
    for path in (done_path(out_dir, step), model_path(out_dir, step), state_path(out_dir, step)):
        if os.path.exists(path):
            os.remove(path)


def load(out_dir, step, model, optimizer, loader):
    """Restore parameters, optimizer state and data position from the checkpoint at `step`.

    Raises formats.FormatError if the checkpoint's model differs from the one this run builds."""
    config, params, _ = formats.read_model(model_path(out_dir, step))
    if config != model.config:
        raise formats.FormatError(f"{model_path(out_dir, step)}: checkpoint model {config} differs from the "
                                  f"model given by -e, {model.config}")
    model.load_params(params)
    state = formats.read_state(state_path(out_dir, step), model.config.num_parameters)
    optimizer.load_full_state(state["m"], state["v"], state["master"])
    loader.set_state(state["loader_state"])
    return state["step"]
