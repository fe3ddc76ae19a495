"""Sampling text from the model as llm.c does: xorshift* coins, seed 1337, inverse-CDF sampling over V."""
import numpy as np

MASK64 = (1 << 64) - 1


class Rng:
    """llm.c's 64-bit xorshift* generator (llmc/sampler.h)."""

    def __init__(self, seed):
        self.state = seed & MASK64

    def u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & MASK64
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & MASK64) >> 32

    def f32(self):
        """A float in [0, 1) from the top 24 bits of a draw."""
        return (self.u32() >> 8) / 16777216.0


def sample_softmax(logits, coin):
    """Index i where the running sum of softmax(logits) first exceeds coin (the last index if none)."""
    p = np.exp(logits.astype(np.float64) - logits.max())
    cdf = np.cumsum(p / p.sum())
    return min(int(np.searchsorted(cdf, coin, side="right")), len(logits) - 1)


def generate(model, eot, gen_tokens, max_T):
    """gen_tokens tokens from an EOT start, one forward per token over a window rounded up to a
    multiple of min(max_T, 256), as llm.c does to keep the shapes (and activation buffers) few."""
    rng = Rng(1337)
    V = model.config.vocab_size
    chunk = min(max_T, 256)
    tokens = [eot]
    for t in range(1, gen_tokens):
        T = min(-(-t // chunk) * chunk, max_T)
        window = np.full((1, T), eot, np.int32)
        window[0, :t] = tokens[-T:] if t > T else tokens
        logits = model.forward(window)
        row = model.backend.to_numpy(logits[0, min(t, T) - 1, :V]).astype(np.float32)
        tokens.append(sample_softmax(row, rng.f32()))
    return tokens[1:]
