"""Causal self-attention on the GPU: one class per algorithm, each owning its kernels, scratch and
saved shape.

  NaiveAttention   fp32, the checking precision: cuBLAS around a causal softmax (kernels/attention.cu), exact
                   to fp32; keeps att, the (B, NH, T, T) probabilities, for the backward
  FlashAttention   bf16: kernels/flash_attention.cu (FlashAttention-2 on mma.sync); keeps only each row's
                   log-sum-exp (B, NH, T) in fp32, and the backward recomputes the probabilities tile by tile
  HopperFlashAttention   the same on Hopper (H100, H200): kernels/flash_attention_hopper.cu (wgmma, TMA,
                   a producer warpgroup and consumer warpgroups); the default wherever the GPU is one
  CudnnAttention   bf16, --attention cudnn: cuDNN's fused attention on flash attention's buffers
                   (cudnn_attention.py, which needs the optional cudnn package)

The cupy backend picks one when it is built and hands it the contract's three attention ops
(llm/backends/__init__.py): saved_shape(B, T, NH) -> (shape, dtype), forward(out, saved, qkv, NH) and
backward(dqkv, dout, qkv, out, saved, NH). The flash kernels also add up dqkv's columns as they write it, for
the qkv layer's bias gradient: their backward returns those partial sums (rows, 3C) fp32, which the backend
adds up; the others return None.
"""
import math

import numpy as np

from .cuda import BF16, BLOCK, FP32, TensorMaps, blocks, check_packs


class NaiveAttention:
    """q k^T / sqrt(hs), the causal softmax, times v: batched cuBLAS GEMMs over (B * NH) heads, between a
    permute that splits qkv (B, T, 3C) into q, k, v (B, NH, T, hs) each and one that merges them back."""
    name = "naive"

    def __init__(self, kernels, scratch, blas, dtype):
        self.kernels, self.scratch, self.blas, self.dtype = kernels, scratch, blas, dtype

    def saved_shape(self, B, T, NH):
        return (B, NH, T, T), FP32   # att

    def scratch_shapes(self, B, T, NH, hs):
        """name -> (shape, dtype) of the scratch that forward and backward take (for them and the memory
        estimate): q, k, v and their gradients split into heads, the output before its merge, the (T, T)
        gradient."""
        return {"qkvp": ((3, B, NH, T, hs), self.dtype), "atty": ((B, NH, T, hs), self.dtype),
                "dqkvp": ((3, B, NH, T, hs), self.dtype), "datt": ((B, NH, T, T), self.dtype)}

    def _scratch(self, name, B, T, NH, hs):
        return self.scratch.get(name, *self.scratch_shapes(B, T, NH, hs)[name])

    def forward(self, out, att, qkv, NH):
        B, T, C3 = qkv.shape
        hs = C3 // 3 // NH
        check_packs((qkv, out, att), T=T, hs=hs)
        qkvp = self._scratch("qkvp", B, T, NH, hs)
        q, k, v = qkvp
        y = self._scratch("atty", B, T, NH, hs)
        self._permute("permute", qkvp, qkv, B, T, 3, NH, hs)
        # per (b, head): preatt (T, T) = q k^T / sqrt(hs); column-major preatt^T = op_T(k) q^T
        self.blas.gemm("T", "N", T, T, hs, k, hs, q, hs, att, T, alpha=1.0 / math.sqrt(hs),
                       batch=B * NH, stride_a=T * hs, stride_b=T * hs, stride_c=T * T)
        self._softmax("softmax_forward", att, rows=B * NH * T, T=T)
        # y (T, hs) = att v; column-major y^T = v^T att^T
        self.blas.gemm("N", "N", hs, T, T, v, hs, att, T, y, hs,
                       batch=B * NH, stride_a=T * hs, stride_b=T * T, stride_c=T * hs)
        self._permute("unpermute", out, y, B, T, 1, NH, hs)

    def backward(self, dqkv, dout, qkv, out, att, NH):
        # y = att v: datt = dy v^T, dv = att^T dy; softmax backward gives dpreatt;
        # preatt = q k^T / sqrt(hs): dq = dpreatt k / sqrt(hs), dk = dpreatt^T q / sqrt(hs)
        B, T, C3 = qkv.shape
        hs = C3 // 3 // NH
        scale = 1.0 / math.sqrt(hs)
        check_packs((qkv, dqkv, dout, att), T=T, hs=hs)
        qkvp = self._scratch("qkvp", B, T, NH, hs)
        q, k, v = qkvp
        dqkvp = self._scratch("dqkvp", B, T, NH, hs)
        dq, dk, dv = dqkvp
        dy = self._scratch("atty", B, T, NH, hs)
        datt = self._scratch("datt", B, T, NH, hs)
        batched = dict(batch=B * NH)
        self._permute("permute", qkvp, qkv, B, T, 3, NH, hs)
        self._permute("permute", dy, dout, B, T, 1, NH, hs)
        # datt (T, T) = dy v^T; column-major datt^T = op_T(v) dy^T
        self.blas.gemm("T", "N", T, T, hs, v, hs, dy, hs, datt, T,
                       stride_a=T * hs, stride_b=T * hs, stride_c=T * T, **batched)
        # dv (T, hs) = att^T dy; column-major dv^T = dy^T op_T(att^T)
        self.blas.gemm("N", "T", hs, T, T, dy, hs, att, T, dv, hs,
                       stride_a=T * hs, stride_b=T * T, stride_c=T * hs, **batched)
        self._softmax("softmax_backward", datt, att, rows=B * NH * T, T=T)
        # dq (T, hs) = dpreatt k * scale; column-major dq^T = k^T dpreatt^T
        self.blas.gemm("N", "N", hs, T, T, k, hs, datt, T, dq, hs, alpha=scale,
                       stride_a=T * hs, stride_b=T * T, stride_c=T * hs, **batched)
        # dk (T, hs) = dpreatt^T q * scale; column-major dk^T = q^T op_T(dpreatt^T)
        self.blas.gemm("N", "T", hs, T, T, q, hs, datt, T, dk, hs, alpha=scale,
                       stride_a=T * hs, stride_b=T * T, stride_c=T * hs, **batched)
        self._permute("unpermute", dqkv, dqkvp, B, T, 3, NH, hs)

    def _permute(self, name, out, inp, B, T, S, NH, hs):
        pack = 16 // out.dtype.itemsize
        self.kernels.get("attention", name, self.dtype)(
            (blocks(out.size // pack),), (BLOCK,),
            (out, inp, np.int32(B), np.int32(T), np.int32(S), np.int32(NH), np.int32(hs)))

    def _softmax(self, name, *args, rows, T):
        self.kernels.get("attention", name, self.dtype)((blocks(rows, BLOCK // 32),), (BLOCK,),
                                                        (*args, np.int32(rows), np.int32(T)))


class FlashAttention:
    """FlashAttention-2 (kernels/flash_attention.cu). Its tiles are set here and compiled into the kernels as
    defines, so that the grid below and the code it launches cannot disagree: a block of WARPS warps owns BQ
    = 16 * WARPS query rows (forward, dQ) or BK key rows (dK, dV); one module per head size HS."""
    name = "flash"
    BQ, BK, WARPS = 64, 64, 4
    HEAD_SIZES = (16, 32, 64)

    def __init__(self, kernels, scratch):
        self.kernels, self.scratch = kernels, scratch

    def saved_shape(self, B, T, NH):
        return (B, NH, T), FP32   # lse, in log2 units (kernels/flash_tiles.cuh: finish_softmax)

    def scratch_shapes(self, B, T, NH, hs):
        """name -> (shape, dtype) of the backward's scratch, also the estimate's: D, a float a row, and the
        column sums of dqkv, one row per 16 rows (a warp's) of each sequence."""
        return {"flash_D": ((B, NH, T), FP32), "flash_bias_sums": ((B * blocks(T, 16), 3 * NH * hs), FP32)}

    def _kernel(self, name, hs):
        return self.kernels.get("flash_attention", name, BF16, HS=hs, BQ=self.BQ, BK=self.BK,
                                WARPS=self.WARPS)

    def _head_size(self, qkv, NH):
        hs = qkv.shape[-1] // 3 // NH
        if hs not in self.HEAD_SIZES:
            raise ValueError(f"flash attention is built for head sizes {self.HEAD_SIZES}, got {hs} (C / NH)")
        return hs

    def forward(self, out, lse, qkv, NH):
        B, T, _ = qkv.shape
        hs = self._head_size(qkv, NH)
        check_packs((out, qkv), hs=hs)
        self._kernel("flash_forward", hs)((blocks(T, self.BQ), B * NH), (32 * self.WARPS,),
                                          (out, lse, qkv, np.int32(T), np.int32(NH), np.float32(hs ** -0.5)))

    def _backward_scratch(self, dqkv, dout, qkv, out, NH):
        """The backward's D = rowsum(dout * out) (B, NH, T) fp32, which the dQ kernel writes and the dK, dV
        kernel reads, and the buffer of dqkv's column sums; -> (B, T, hs, D, bias_sums)."""
        B, T, _ = qkv.shape
        hs = self._head_size(qkv, NH)
        check_packs((dqkv, dout, qkv, out), hs=hs)
        shapes = self.scratch_shapes(B, T, NH, hs)
        D, bias_sums = (self.scratch.get(name, *shapes[name]) for name in ("flash_D", "flash_bias_sums"))
        return B, T, hs, D, bias_sums

    def backward(self, dqkv, dout, qkv, out, lse, NH):
        # dQ per query tile, which also writes D = rowsum(dout * out), then dK and dV per key tile
        # (deterministic sums); each warp also writes the column sums of its 16 rows of dqkv, which it returns
        B, T, hs, D, bias_sums = self._backward_scratch(dqkv, dout, qkv, out, NH)
        rest = (lse, D, np.int32(T), np.int32(NH), np.float32(hs ** -0.5))
        threads = (32 * self.WARPS,)
        self._kernel("flash_backward_dq", hs)((blocks(T, self.BQ), B * NH), threads,
                                              (dqkv, bias_sums, dout, out, qkv, *rest))
        self._kernel("flash_backward_dkv", hs)((blocks(T, self.BK), B * NH), threads,
                                               (dqkv, bias_sums, dout, qkv, *rest))
        return bias_sums


class HopperFlashAttention(FlashAttention):
    """FlashAttention on sm_90a (kernels/flash_attention_hopper.cu): the same saved lse and two-pass
    backward (dQ and D, then dK and dV) as FlashAttention, with every tile brought in by the copy engine
    through a tensor map and multiplied by wgmma. A block is one producer warpgroup and CONSUMERS[kernel]
    consumer warpgroups, each owning 64 rows; STAGES tiles are in flight between them. The kernels are
    persistent: one block per SM, each walking its share of the items (64 rows per consumer, of one head).
    The kernels export the bytes of shared memory their layouts take, which the launch reads back."""
    name = "flash-hopper"
    # consumer warpgroups per kernel: the dK, dV kernel reads K and V from shared memory, which leaves room
    # for a third (its comment says what it gains); the forward's three, on key tiles of 64, take
    # 0.345-0.354 ms a layer against 0.362-0.370 for two on tiles of 128 (d12 B=64, H100); dQ's three,
    # skipping the rows past T, make the backward 0.927 ms a layer against 0.960 for two (d12 B=64, H100)
    CONSUMERS = dict(flash_forward=3, flash_backward_dq=3, flash_backward_dkv=3)
    STAGES, FORWARD_TILE, BACKWARD_TILE = 3, 64, 64   # three stages: the fastest measured on an H200
    GROUP_HEADS = 64   # items are ordered by row tile within groups of this many heads (the kernels say why)
    COPY_ROWS = 64     # rows the copy engine moves at once

    def __init__(self, kernels, scratch, num_sms):
        super().__init__(kernels, scratch)
        self.maps, self.num_sms = TensorMaps(), num_sms

    def _launch(self, name, hs, T, B, NH, args):
        # persistent: one block per SM walks the blocks(T, rows) * B * NH items (the kernels' header says why)
        consumers = self.CONSUMERS[name]
        defines = dict(HS=hs, CONSUMERS=consumers, STAGES=self.STAGES, FORWARD_TILE=self.FORWARD_TILE,
                       BACKWARD_TILE=self.BACKWARD_TILE, GROUP_HEADS=self.GROUP_HEADS)
        kernel = self.kernels.get("flash_attention_hopper", name, BF16, arch="sm_90a", **defines)
        shared = self.kernels.value("flash_attention_hopper", f"{name}_smem", BF16, arch="sm_90a", **defines)
        if kernel.max_dynamic_shared_size_bytes < shared:
            kernel.max_dynamic_shared_size_bytes = shared
        grid = min(self.num_sms, blocks(T, 64 * consumers) * B * NH)
        kernel((grid,), (128 * (1 + consumers),), args, shared_mem=shared)

    def forward(self, out, lse, qkv, NH):
        B, T, _ = qkv.shape
        hs = self._head_size(qkv, NH)
        check_packs((out, qkv), hs=hs)
        qkv_map = self.maps.rows(qkv, hs, self.COPY_ROWS)
        self._launch("flash_forward", hs, T, B, NH,
                     (out, lse, qkv_map, np.int32(T), np.int32(NH), np.int32(B * NH), np.float32(hs ** -0.5)))

    def backward(self, dqkv, dout, qkv, out, lse, NH):
        B, T, hs, D, bias_sums = self._backward_scratch(dqkv, dout, qkv, out, NH)
        dout_map, out_map, qkv_map = (self.maps.rows(x, hs, self.COPY_ROWS) for x in (dout, out, qkv))
        rest = (lse, D, np.int32(T), np.int32(NH), np.int32(B * NH), np.float32(hs ** -0.5))
        self._launch("flash_backward_dq", hs, T, B, NH, (dqkv, bias_sums, dout_map, out_map, qkv_map, *rest))
        self._launch("flash_backward_dkv", hs, T, B, NH, (dqkv, bias_sums, dout_map, qkv_map, *rest))
        return bias_sums
