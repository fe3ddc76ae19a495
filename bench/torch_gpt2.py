"""A yardstick, not part of the project: the same GPT-2 training step in PyTorch with torch.compile, to be
timed side by side with bench/step.py on the same GPU, model and batch. Needs torch (never a dependency).

    python -m bench.torch_gpt2 [--model d12] [-b 64] [-t 1024] [--steps 20] [--no-compile]
                               [--sdpa cudnn|flash] [--loss padded|sliced]

Written as nanoGPT's model.py writes it, which is how users run it: bf16 autocast with fp32 weights, causal
scaled_dot_product_attention, tied lm_head, N(0, 0.02) init, and the cross-entropy over all Vp = 50,304
padded logits (the padded columns carry no targets; --loss sliced takes logits[..., :V] first, a variant
that costs torch 8-10% more). GELU is llm.c's tanh form, fused AdamW with betas (0.9, 0.95), gradient
clipping at 1.0: llm.c's step. The timed steps run back to back, as nanoGPT's loop runs them, with no wait
for the GPU between them: the time of all of them over their number is the ms/step printed, beside tok/s
and the peak memory (torch's allocator, and nvidia-smi sampled while it runs), after nvidia-smi's SM clock
and power.
"""
import time

from bench import check_length, model_arguments, needs, needs_torch_gpu
from bench.gpu_sampler import GpuSampler
from llm.config import GPT2Config
from llm.launch import Parser, UserError, positive_int, run

needs("torch")
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.attproj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attproj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.channels
        self.wte, self.wpe = nn.Embedding(config.padded_vocab_size, C), nn.Embedding(config.max_seq_len, C)
        self.blocks = nn.ModuleList(Block(C, config.num_heads) for _ in range(config.num_layers))
        self.lnf = nn.LayerNorm(C)
        self.V, self.sliced = config.vocab_size, False
        for module in self.modules():   # nanoGPT's _init_weights
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lnf(x) @ self.wte.weight.T
        if self.sliced:
            return F.cross_entropy(logits[..., :self.V].float().flatten(0, 1), targets.flatten())
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())   # nanoGPT: all Vp columns


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--sdpa", choices=["default", "flash", "cudnn"], default="default")
    parser.add_argument("--loss", choices=["padded", "sliced"], default="padded",
                        help="padded: the cross-entropy over all Vp logits, as nanoGPT; "
                             "sliced: over the first V")
    args = parser.parse_args(argv)
    config = GPT2Config.from_descriptor(args.model)
    check_length(parser, args.model, config, args.t)
    needs_torch_gpu(torch)
    torch.manual_seed(0)
    model = GPT(config).cuda()
    model.sliced = args.loss == "sliced"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  fused=True)
    step_fn = model if args.no_compile else torch.compile(model)
    backends = {"flash": [torch.nn.attention.SDPBackend.FLASH_ATTENTION],
                "cudnn": [torch.nn.attention.SDPBackend.CUDNN_ATTENTION]}.get(args.sdpa)
    B, T = args.b, args.t
    x = torch.randint(0, config.vocab_size, (B, T), device="cuda")
    y = torch.randint(0, config.vocab_size, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if backends:
                with torch.nn.attention.sdpa_kernel(backends):
                    loss = step_fn(x, y)
            else:
                loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    try:
        for _ in range(3):   # compiles
            step()
        with GpuSampler(torch.cuda.current_device()) as smi:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1000 / args.steps
    except torch.OutOfMemoryError:   # how bench/gpu_check.sh's d48max stage finds the largest batch
        raise UserError(f"{args.model} B={B} T={T}: out of GPU memory") from None
    mode = "eager" if args.no_compile else "torch.compile"
    print(smi.clock_line())
    print(f"torch {torch.__version__} {mode} sdpa={args.sdpa} loss={args.loss} {args.model} B={B} T={T} "
          f"bf16: loss {loss.item():.4f} | {args.steps} steps in a row: {ms:.1f} ms/step | "
          f"{B * T / ms * 1000:.0f} tok/s | peak memory: "
          f"nvidia-smi {smi.peak_mib if smi.peak_mib is not None else 'n/a'} MiB, torch reserved "
          f"{torch.cuda.max_memory_reserved() / 2**20:.0f} MiB")


if __name__ == "__main__":
    run(main)
