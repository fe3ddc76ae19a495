"""Draw every figure of docs/ into docs/img/, from the code itself, so that a figure cannot disagree with it.

    .venv/bin/python docs/figures.py                 (needs matplotlib: pip install -e ".[plot]")
    .venv/bin/python docs/figures.py --out DIR       somewhere else

  layout.png       the 16 tensors of the flat buffer (llm/layout.py's param_offsets): GPT-2 124M, a toy model
  zero.png         who owns which slice at N = 3, with the padding (llm/zero.py's ZeroOptimizer, per rank)
  flash_tiles.png  the tiles each flash-attention pass visits, in order (reference/flash_attention.py, run
                   with its mask function wrapped to record each tile)
"""
import os

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

import reference.flash_attention as flash
from llm.backends import get_backend
from llm.config import GPT2Config
from llm.launch import Parser
from llm.layout import PARAM_NAMES, param_offsets, tensor_at
from llm.model import GPT2
from llm.zero import ZeroOptimizer, padded_size

IMG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")
# small enough to see every tensor and every element of the padding: P = 592, which 3 does not divide
TOY = GPT2Config(max_seq_len=8, vocab_size=16, padded_vocab_size=16, num_layers=2, num_heads=2, channels=4)
COLORS = dict(zip(PARAM_NAMES, colormaps["tab20"].colors))
PER_LAYER = PARAM_NAMES[2:14]   # ln1w .. fcprojb: stacked (L, ...), layer-major


class RankOnly:
    """What ZeroOptimizer asks of a communicator to cut its shard: this rank and the world size."""

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


def shards(config, world_size):
    """[(lo, hi, [(lo, hi, decay) in flat coordinates])] per rank, from ZeroOptimizer as -z 1 builds it."""
    out, flat_size = [], padded_size(config.num_parameters, world_size, zero_stage=1)
    for rank in range(world_size):
        model = GPT2(config, get_backend("numpy"), flat_size=flat_size)
        optimizer = ZeroOptimizer(model, RankOnly(rank, world_size), zero_stage=1, weight_decay=0.1)
        segments = [(optimizer.lo + lo, optimizer.lo + hi, decay) for lo, hi, decay in optimizer.segments]
        out.append((optimizer.lo, optimizer.hi, segments))
    return out


def tiles(T, NH=1, hs=4, BQ=64, BK=64):
    """{pass: [(i0, i1, j0, j1)] in the order visited}: the tiles of the forward, the dK/dV and the dQ pass,
    recorded by wrapping the mask function that each pass calls once per tile."""
    seen, mask = [], flash.future
    flash.future = lambda i0, i1, j0, j1: seen.append((i0, i1, j0, j1)) or mask(i0, i1, j0, j1)
    try:
        rng = np.random.default_rng(0)
        qkv, dout = rng.standard_normal((1, T, 3 * NH * hs)), rng.standard_normal((1, T, NH * hs))
        out, lse = flash.flash_forward(qkv, NH, BQ, BK)
        passes = {"flash_forward": seen[:]}
        D = flash.flash_backward_dot(dout, out, NH)
        for backward in (flash.flash_backward_dkv, flash.flash_backward_dq):
            seen.clear()
            backward(dout, qkv, lse, D, NH, BQ, BK)
            passes[backward.__name__] = seen[:]
    finally:
        flash.future = mask
    return passes


def draw_tensors(ax, config, y, label):
    """One bar, to scale: the 16 tensors back to back; thin lines between the layers of a stacked tensor."""
    P, L = config.num_parameters, config.num_layers
    for name, (offset, size) in param_offsets(config).items():
        ax.barh(y, size, left=offset, height=0.6, color=COLORS[name], edgecolor="white", linewidth=0.5)
        if name in PER_LAYER:
            for layer in range(1, L):
                ax.plot([offset + layer * size / L] * 2, [y - 0.3, y + 0.3], color="black", lw=0.4)
        if size / P > 0.03:
            ax.text(offset + size / 2, y, name, ha="center", va="center", fontsize=8)
    ax.text(-0.01 * P, y, label, ha="right", va="center", fontsize=9)


def legend(fig):
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[n]) for n in PARAM_NAMES]
    fig.legend(handles, PARAM_NAMES, ncol=8, fontsize=8, loc="upper center", frameon=False)


def draw_layout(path):
    fig = Figure(figsize=(11, 3.2))
    axes = fig.subplots(2, 1)
    for ax, config, label in ((axes[0], GPT2Config(), "GPT-2 124M (d12)\n124,475,904 floats"),
                              (axes[1], TOY, "a toy model\nVp=16 maxT=8 L=2 C=4\n592 floats")):
        draw_tensors(ax, config, 0, label)
        ax.set_xlim(0, config.num_parameters)
        ax.set_ylim(-0.5, 0.5)
        ax.set_yticks([])
        ax.spines[["left", "right", "top"]].set_visible(False)
        ax.set_xlabel("offset in the flat buffer (elements)", fontsize=8)
    legend(fig)
    fig.subplots_adjust(left=0.17, right=0.98, top=0.8, bottom=0.15, hspace=1.0)
    fig.savefig(path, dpi=110)


def draw_zero(path, world_size=3):
    P, owners = TOY.num_parameters, shards(TOY, world_size)
    fig = Figure(figsize=(11, 1.8 + 0.8 * world_size))
    ax = fig.subplots()
    for rank, (lo, hi, segments) in enumerate(owners):
        y = world_size - 1 - rank
        for seg_lo, seg_hi, decay in segments:
            name = tensor_at(TOY, seg_lo)
            ax.barh(y, seg_hi - seg_lo, left=seg_lo - lo, height=0.6, color=COLORS.get(name, "lightgrey"),
                    hatch="///" if decay else None, edgecolor="white", linewidth=0.5)
            label = name or "padding"
            if seg_hi - seg_lo >= 12 or name is None:
                ax.text((seg_lo + seg_hi) / 2 - lo, y + (0.45 if name is None else 0), label, ha="center",
                        va="center", fontsize=7)
        ax.text(-2, y, f"rank {rank}\n[{lo}, {hi})", ha="right", va="center", fontsize=9)
    S = owners[0][1] - owners[0][0]
    ax.set_xlim(0, S)
    ax.set_ylim(-0.6, world_size - 0.2)
    ax.set_yticks([])
    ax.spines[["left", "right", "top"]].set_visible(False)
    ax.set_xlabel(f"offset in the shard: S = ceil({P} / {world_size}) = {S}; hatched: weight decay",
                  fontsize=8)
    ax.set_title(f"ZeRO-1 at N = {world_size}: the toy model's {P} floats padded to {world_size * S}, "
                 f"one contiguous shard per rank", fontsize=9)
    legend(fig)
    fig.subplots_adjust(left=0.12, right=0.98, top=0.72, bottom=0.17)
    fig.savefig(path, dpi=110)


def draw_flash_tiles(path, T=224, B=64):
    passes = tiles(T, BQ=B, BK=B)
    fig = Figure(figsize=(11, 4))
    axes = fig.subplots(1, 3)
    masked = np.triu(np.ones((T, T), bool), 1)   # key j after query i
    for ax, (name, visited) in zip(axes, passes.items()):
        ax.imshow(np.where(masked, 0.85, 1.0), cmap="gray", vmin=0, vmax=1, extent=(0, T, T, 0))
        for order, (i0, i1, j0, j1) in enumerate(visited, 1):
            ax.add_patch(Rectangle((j0, i0), j1 - j0, i1 - i0, fill=False, edgecolor="C0", lw=1.5))
            ax.text((j0 + j1) / 2, (i0 + i1) / 2, str(order), ha="center", va="center", fontsize=10,
                    color="C3")
        ax.set_title(f"{name}", fontsize=9)
        ax.set_xlabel("key j", fontsize=8)
        ax.set_ylabel("query i", fontsize=8)
        ax.set_xticks(range(0, T + 1, B))
        ax.set_yticks(range(0, T + 1, B))
        ax.tick_params(labelsize=7)
    fig.suptitle(f"T = {T}, BQ = BK = {B}: the tiles each pass visits, numbered in the reference's order (on "
                 f"the GPU, one thread block per row of tiles for flash_forward and flash_backward_dq, per "
                 f"column for flash_backward_dkv); grey: masked (j > i)", fontsize=9, wrap=True)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.85, bottom=0.12, wspace=0.3)
    fig.savefig(path, dpi=110)


FIGURES = {"layout.png": draw_layout, "zero.png": draw_zero, "flash_tiles.png": draw_flash_tiles}


def main():
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=IMG, help="the folder to write the images to (default docs/img)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, draw in FIGURES.items():
        draw(os.path.join(args.out, name))
        print(f"wrote {os.path.join(args.out, name)}")


if __name__ == "__main__":
    main()
