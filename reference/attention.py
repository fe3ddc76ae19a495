"""Causal multi-head self-attention on the fused qkv vector (as llm.c).

At each position the 3C vector holds q, k, v back to back; head h's q is qkv[h*hs : (h+1)*hs], its k
sits C further on and its v 2C further on. Position t attends to positions t2 <= t only.
"""
import math

import numpy as np


def split_heads(qkv, NH):
    """qkv (B, T, 3C) -> q, k, v, each (B, NH, T, hs)."""
    B, T, C3 = qkv.shape
    hs = C3 // 3 // NH
    return qkv.reshape(B, T, 3, NH, hs).transpose(2, 0, 3, 1, 4)


def merge_heads(x):
    """(B, NH, T, hs) -> (B, T, NH * hs): head h's channels at h*hs."""
    B, NH, T, hs = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, NH * hs)


def attention_forward(qkv, NH):
    """qkv (B, T, 3C) -> out (B, T, C), att (B, NH, T, T), the probabilities kept for the backward."""
    q, k, v = split_heads(qkv, NH)
    T, hs = q.shape[-2:]
    preatt = q @ k.swapaxes(-1, -2) / math.sqrt(hs)                 # (B, NH, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))                   # t2 <= t
    preatt = np.where(causal, preatt, -np.inf)                      # exp(-inf) = 0: masked att is 0
    e = np.exp(preatt - preatt.max(axis=-1, keepdims=True))
    att = e / e.sum(axis=-1, keepdims=True)
    return merge_heads(att @ v), att


def attention_backward(dout, qkv, att, NH):
    """dout (B, T, C) -> dqkv (B, T, 3C).

    out = att v, att = softmax(preatt) over t2 <= t, preatt = q k^T * scale, scale = 1/sqrt(hs):
      dv = att^T dout,  datt = dout v^T
      dpreatt = att * (datt - sum_t2 att * datt)   (softmax backward; masked entries have att = 0, so 0)
      dq = dpreatt k * scale,  dk = dpreatt^T q * scale"""
    q, k, v = split_heads(qkv, NH)
    hs = q.shape[-1]
    B, T, C = dout.shape
    dout = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)        # (B, NH, T, hs)
    dv = att.swapaxes(-1, -2) @ dout
    datt = dout @ v.swapaxes(-1, -2)                                # (B, NH, T, T)
    dpreatt = att * (datt - (att * datt).sum(axis=-1, keepdims=True))
    dq = dpreatt @ k / math.sqrt(hs)
    dk = dpreatt.swapaxes(-1, -2) @ q / math.sqrt(hs)
    return np.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)
