"""cuDNN's fused attention as an option (--attention cudnn), as llm.c's USE_CUDNN=1 build.

The same job as kernels/flash_attention.cu, on the same buffers: q, k and v read in place from the (B, T, 3C)
qkv buffer, the output written to (B, T, C), and the per-row softmax statistics (B, NH, T) in fp32 kept for
the backward in the place flash attention keeps its log-sum-exp. cuDNN's graph API describes each tensor by
its dimensions and strides, so the heads need no permute: q is (B, NH, T, hs) with strides (3CT, hs, 3C, 1)
at the start of qkv, k the same C elements further on and v 2C. One forward and one backward graph are built
per shape, the first time it is seen, and run on CuPy's current stream.

Needs the nvidia-cudnn-frontend package (pip install -e ".[cudnn]") and cuDNN itself.
"""
import cupy

from llm.launch import install

from . import BackendError

try:
    import cudnn
except (ImportError, OSError) as e:   # OSError: the package is there but libcudnn is not
    raise ImportError(f"--attention cudnn needs cuDNN's Python frontend: {install('cudnn')} ({e})") from None

Q, K, V, O, STATS, DO, DQ, DK, DV = range(1, 10)   # the uids that bind each graph tensor to a buffer


class CudnnAttention:
    name = "cudnn"

    def __init__(self):
        self.handle = cudnn.create_handle()
        self.graphs = {}           # (B, T, NH, hs) -> (forward graph, backward graph)
        self.workspace = cupy.empty(0, cupy.uint8)

    def saved_shape(self, B, T, NH):
        return (B, NH, T), cupy.float32   # the softmax statistics, where flash attention keeps its lse

    def scratch_shapes(self, B, T, NH, hs):
        """None of ours: cuDNN sizes its workspace when it plans a shape, which the memory estimate cannot
        know."""
        return {}

    def _graphs(self, B, T, NH, hs):
        key = (B, T, NH, hs)
        if key not in self.graphs:
            C = NH * hs
            try:
                self.graphs[key] = (self._build(B, T, NH, hs, C, backward=False),
                                    self._build(B, T, NH, hs, C, backward=True))
            except cudnn.cudnnGraphNotSupportedError as e:   # T = 1, for one: a shape cuDNN does not take
                raise BackendError(f"--attention cudnn: cuDNN cannot run attention at B={B} T={T} NH={NH} "
                                   f"hs={hs} ({str(e).splitlines()[0]}): use the default attention") from None
            size = max(g.get_workspace_size() for g in self.graphs[key])
            if size > self.workspace.size:
                self.workspace = cupy.empty(size, cupy.uint8)
        return self.graphs[key]

    def _build(self, B, T, NH, hs, C, backward):
        graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                              intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        heads = [B, NH, T, hs]
        # strides of the (B, T, 3C), (B, T, C) buffers
        in_qkv, in_out = [3 * C * T, hs, 3 * C, 1], [C * T, hs, C, 1]

        def tensor(uid, stride, dims=heads, dtype=cudnn.data_type.BFLOAT16):
            return graph.tensor(dim=dims, stride=stride, data_type=dtype).set_uid(uid)
        q, k, v = tensor(Q, in_qkv), tensor(K, in_qkv), tensor(V, in_qkv)
        stats_dims, stats_stride = [B, NH, T, 1], [NH * T, T, 1, 1]
        scale = hs ** -0.5
        if not backward:
            o, stats = graph.sdpa(q=q, k=k, v=v, is_inference=False, attn_scale=scale, use_causal_mask=True,
                                  name="attention")
            o.set_output(True).set_dim(heads).set_stride(in_out).set_uid(O)
            stats.set_output(True).set_dim(stats_dims).set_stride(stats_stride).set_uid(STATS)
            stats.set_data_type(cudnn.data_type.FLOAT)
        else:
            o, do = tensor(O, in_out), tensor(DO, in_out)
            stats = tensor(STATS, stats_stride, stats_dims, cudnn.data_type.FLOAT)
            grads = graph.sdpa_backward(q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=scale,
                                        use_causal_mask=True, use_deterministic_algorithm=True,
                                        name="attention_backward")
            for grad, uid in zip(grads, (DQ, DK, DV)):
                grad.set_output(True).set_dim(heads).set_stride(in_qkv).set_uid(uid)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return graph

    def _run(self, graph, pack):
        cudnn.set_stream(self.handle, cupy.cuda.get_current_stream().ptr)
        graph.execute(pack, self.workspace.data.ptr, handle=self.handle)

    def forward(self, out, stats, qkv, NH):
        B, T, C3 = qkv.shape
        C, step = C3 // 3, C3 // 3 * qkv.itemsize
        forward, _ = self._graphs(B, T, NH, C // NH)
        p = qkv.data.ptr
        self._run(forward, {Q: p, K: p + step, V: p + 2 * step, O: out.data.ptr, STATS: stats.data.ptr})

    def backward(self, dqkv, dout, qkv, out, stats, NH):
        B, T, C3 = qkv.shape
        C, step = C3 // 3, C3 // 3 * qkv.itemsize
        _, backward = self._graphs(B, T, NH, C // NH)
        p, d = qkv.data.ptr, dqkv.data.ptr
        self._run(backward, {Q: p, K: p + step, V: p + 2 * step, O: out.data.ptr, STATS: stats.data.ptr,
                             DO: dout.data.ptr, DQ: d, DK: d + step, DV: d + 2 * step})
