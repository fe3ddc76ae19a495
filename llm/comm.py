"""Communicators: the collectives that data parallelism and ZeRO need, behind one small interface.

  SingleComm   one process: every collective is the identity
  MPIComm      several processes through mpi4py, on host arrays (device arrays are staged through the host)
  NCCLComm     several processes, one GPU each, through cupy.cuda.nccl on device arrays

Every communicator offers, on contiguous 1-D buffers:
  all_reduce_avg(buf), all_reduce_sum(buf)   in place
  reduce_scatter_avg(flat, shard)            shard (len S) = average over ranks of flat[rank*S:(rank+1)*S];
                                             shard may be that very slice of flat
  all_gather(shard, flat)                    flat[r*S:(r+1)*S] = rank r's shard; shard may be its own slice
  barrier(), scalar_sum(x) -> float, scalar_avg(x) -> float
and, on small Python objects (a decision, a fingerprint, an error message):
  broadcast_object(x) -> rank 0's x          all_gather_object(x) -> [rank 0's x, rank 1's x, ...]
The model and the optimizer never ask which one they hold.
"""
import numpy as np

from .launch import launched_world_size


def _is_device_array(buf):
    return type(buf).__module__.startswith("cupy")


def _ptr(x):
    """Address of an array's first element, host or device: tells whether two views are the same memory."""
    return x.data.ptr if _is_device_array(x) else x.__array_interface__["data"][0]


class SingleComm:
    """One process: nothing to exchange."""
    rank, world_size, local_rank = 0, 1, 0
    name = "single process"

    def all_reduce_avg(self, buf):
        pass

    def all_reduce_sum(self, buf):
        pass

    def reduce_scatter_avg(self, flat, shard):
        if _ptr(shard) != _ptr(flat):
            shard[...] = flat[:shard.size]

    def all_gather(self, shard, flat):
        if _ptr(shard) != _ptr(flat):
            flat[:shard.size] = shard

    def barrier(self):
        pass

    def scalar_sum(self, x):
        return float(x)

    def scalar_avg(self, x):
        return float(x)

    def broadcast_object(self, x):
        return x

    def all_gather_object(self, x):
        return [x]


class MPIComm:
    """Processes launched by mpirun, exchanging host arrays through mpi4py.

    MPI has no bfloat16, so device and 16-bit buffers are staged through the host: as float32 for
    reductions, as raw 16-bit words for gathers. This is also the fallback when ranks outnumber GPUs
    (NCCL refuses two ranks on one GPU)."""
    name = "MPI"

    def __init__(self):
        from mpi4py import MPI
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        # local rank = how many lower ranks share this host: it picks the GPU on a multi-GPU node
        hosts = self.comm.allgather(MPI.Get_processor_name())
        self.local_rank = hosts[:self.rank].count(hosts[self.rank])

    @staticmethod
    def _to_host(buf, raw=False):
        """buf itself if it is a host float32/float64 array, else a host copy: float32 or (raw) 16-bit
        words."""
        host = buf.get() if _is_device_array(buf) else buf
        if host.dtype.itemsize == 2:
            return host.view(np.uint16).copy() if raw else host.astype(np.float32)
        return host.copy() if raw and host is buf else host

    @staticmethod
    def _from_host(buf, host):
        if host is buf:
            return
        if host.dtype == np.uint16:
            host = host.view(buf.dtype)
        host = np.ascontiguousarray(host.astype(buf.dtype, copy=False))
        if _is_device_array(buf):
            buf.set(host)
        else:
            buf[...] = host

    def all_reduce_avg(self, buf):
        self._all_reduce(buf, average=True)

    def all_reduce_sum(self, buf):
        self._all_reduce(buf, average=False)

    def _all_reduce(self, buf, average):
        host = self._to_host(buf)
        self.comm.Allreduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM)
        if average:
            host /= self.world_size
        self._from_host(buf, host)

    def reduce_scatter_avg(self, flat, shard):
        send = self._to_host(flat)
        # MPI forbids the receive buffer aliasing the send buffer
        recv = np.empty(shard.size, dtype=send.dtype)
        self.comm.Reduce_scatter_block(send, recv, op=self.MPI.SUM)
        recv /= self.world_size
        self._from_host(shard, recv)

    def all_gather(self, shard, flat):
        host = self._to_host(flat, raw=True)
        S = shard.size
        host[self.rank * S:(self.rank + 1) * S] = self._to_host(shard, raw=True)
        self.comm.Allgather(self.MPI.IN_PLACE, host)    # each rank's part is taken from its own slot
        self._from_host(flat, host)

    def barrier(self):
        self.comm.Barrier()

    def scalar_sum(self, x):
        return self.comm.allreduce(float(x), op=self.MPI.SUM)

    def scalar_avg(self, x):
        return self.scalar_sum(x) / self.world_size

    def broadcast_object(self, x):
        return self.comm.bcast(x, root=0)

    def all_gather_object(self, x):
        return self.comm.allgather(x)


class NCCLComm:
    """One GPU per rank, collectives on device buffers through cupy.cuda.nccl.

    mpi4py launched the ranks; rank 0 makes the NCCL id and MPI broadcasts it. Reductions run in the
    buffer's own precision (bf16 grads are averaged in bf16, as llm.c does)."""
    name = "NCCL"

    def __init__(self, mpi_comm):
        import cupy
        from cupy.cuda import nccl
        self.cupy, self.nccl, self.mpi = cupy, nccl, mpi_comm
        self.rank, self.world_size, self.local_rank = mpi_comm.rank, mpi_comm.world_size, mpi_comm.local_rank
        cupy.cuda.Device(self.local_rank).use()
        uid = mpi_comm.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        self.comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)

    def _dtype(self, buf):
        n = self.nccl
        return {4: n.NCCL_FLOAT32, 8: n.NCCL_FLOAT64}.get(buf.dtype.itemsize, n.NCCL_BFLOAT16)

    def _stream(self):
        return self.cupy.cuda.get_current_stream().ptr

    def all_reduce_avg(self, buf):
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), self.nccl.NCCL_AVG,
                            self._stream())

    def all_reduce_sum(self, buf):
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), self.nccl.NCCL_SUM,
                            self._stream())

    def reduce_scatter_avg(self, flat, shard):
        self.comm.reduceScatter(flat.data.ptr, shard.data.ptr, shard.size, self._dtype(flat),
                                self.nccl.NCCL_AVG, self._stream())

    def all_gather(self, shard, flat):
        self.comm.allGather(shard.data.ptr, flat.data.ptr, shard.size, self._dtype(flat), self._stream())

    def barrier(self):
        self.cupy.cuda.get_current_stream().synchronize()
        self.mpi.barrier()

    def scalar_sum(self, x):
        return self.mpi.scalar_sum(float(x))

    def scalar_avg(self, x):
        return self.mpi.scalar_avg(float(x))

    def broadcast_object(self, x):
        return self.mpi.broadcast_object(x)

    def all_gather_object(self, x):
        return self.mpi.all_gather_object(x)


def make_comm(gpu=False, force_nccl=False):
    """The communicator for how this process was launched: single process, MPI, or NCCL between GPUs.

    With gpu=True this also picks this rank's GPU (local rank modulo the GPUs on the node), so call it
    before building the backend. force_nccl uses NCCL even for a single rank."""
    world_size = launched_world_size()
    if world_size == 1 and not force_nccl:
        return SingleComm()
    comm = MPIComm()
    if not gpu:
        return comm if comm.world_size > 1 else SingleComm()
    import cupy
    n_gpus = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(comm.local_rank % n_gpus).use()
    if comm.comm.allreduce(int(comm.local_rank >= n_gpus), op=comm.MPI.SUM):
        if comm.rank == 0:
            print(f"{comm.world_size} ranks but only {n_gpus} GPU(s) per node, and NCCL refuses two ranks "
                  f"on one GPU: falling back to host-staged MPI collectives")
        return comm
    return NCCLComm(comm)
