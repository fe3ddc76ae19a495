"""CUDA graphs: a forward's or a backward's launches recorded once, then replayed with one launch.

  Graph       one recording, made by running work() on a capturing stream (needs cupy)
  GraphCache  run(key, work): the protocol that decides when to run, record or replay (plain Python, so
              that it is tested on the CPU with a stand-in recorder)

The cupy backend owns a GraphCache (backend.run); the model only names its work and never asks whether
it is recorded.
"""


class Graph:
    """A CUDA graph: the launches that work() makes, recorded once, then replayed with one launch.

    Recording runs nothing: each kernel, GEMM and copy that work() issues on the recording stream is
    written down with its arguments (buffer addresses, sizes, scalars). replay() runs them all again, in
    order, on the GPU, without Python issuing each one. So a replay reads whatever the buffers hold at
    that moment, and every buffer work() touches must stay where it is for as long as the graph lives:
    `keep` holds the backend's scratch buffers of this moment, in case a later shape replaces them.

    The recording stream is a blocking stream, which the default stream (where everything else runs)
    waits for and which waits for the default stream: a replay starts after the work queued before it
    and finishes before the work queued after it. Temporaries that work() allocates while recording
    come from a memory pool of the graph's own, which nothing else draws from, so no later array is
    given memory that a replay still writes."""

    def __init__(self, work, keep):
        import cupy
        self.stream, self.pool, self.keep = cupy.cuda.Stream(), cupy.cuda.MemoryPool(), keep
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                work()
            finally:
                self.graph = self.stream.end_capture()

    def replay(self):
        self.graph.launch(self.stream)


class GraphCache:
    """One recorded graph per key: the first call for a key runs its work directly (this compiles the
    kernels, plans the GEMMs and allocates the scratch, none of which a recording may do); the second
    records the work as a graph (recording runs nothing), and that call and every later one replays it:
    the same kernels, in the same order, on the same buffers, so the results are the same to the bit.

    A key must name everything a recording depends on: the buffers (the model passes its activations
    object, which holds them, and keeps them alive as long as the graph) and the scalars baked into
    the launches (the backward's dloss)."""

    def __init__(self, record):
        self.record = record   # work -> an object with replay()
        self.graphs = {}       # key -> None (seen once) or a recording

    def run(self, key, work):
        if key not in self.graphs:
            self.graphs[key] = None
            work()
            return
        if self.graphs[key] is None:
            self.graphs[key] = self.record(work)
        self.graphs[key].replay()
