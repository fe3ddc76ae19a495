"""A checkpoint as a Hugging Face model folder, which transformers and lm-evaluation-harness load offline.

  python -m llm.export -e log124M/model_00018865.bin --out gpt2-fineweb     one checkpoint
  python -m llm.export -e log124M --out gpt2-fineweb --dtype fp32           a run's newest complete checkpoint
  python -m llm.export -e log124M --out gpt2-fineweb --push USER/gpt2-fw    and upload the folder to the Hub

The folder holds what GPT2LMHeadModel.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR) read:
  model.safetensors        the parameters, named and laid out as Hugging Face's GPT-2 (llm/hf.py): wte
                           without llm.c's padding rows, the lm_head tied to it
  config.json              the sizes, GELU's tanh form (gelu_new), no dropout
  generation_config.json   EOT (50256) begins and ends a text
  vocab.json, merges.txt   GPT-2's byte-level BPE, spelled from the BPE ranks of --vocab (llm/tokenizer.py)
  tokenizer_config.json    GPT2Tokenizer, with EOT as its special token
This is llm.c's dev/eval/export_hf.py without PyTorch: NumPy lays the tensors out and safetensors writes
them, in the checkpoint's precision unless --dtype says otherwise (bf16 is the fp32 value rounded to nearest
even, as llm.c's writer does). The model file may be ours or llm.c's, version 3 (fp32) or 5 (bf16); its
vocabulary must be GPT-2's, since the tokenizer files are.
"""
import json
import os
import re

import numpy as np

from llm import formats
from llm.checkpoint import find_model
from llm.config import GPT2_VOCAB
from llm.hf import CONFIG_SIZES, PREFIX, WEIGHTS, hf_views
from llm.launch import Parser, UserError, install, optional, output_dir, run
from llm.layout import ParamViews
from llm.tokenizer import ENDOFTEXT, Tokenizer, byte_to_unicode, recover_merges

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}   # --dtype -> torch's name, which config.json gives
CONFIG, GENERATION, VOCAB, MERGES, TOKENIZER = ("config.json", "generation_config.json", "vocab.json",
                                                "merges.txt", "tokenizer_config.json")
FILES = (WEIGHTS, CONFIG, GENERATION, VOCAB, MERGES, TOKENIZER)
MERGES_HEADER = "#version: 0.2\n"   # GPT2Tokenizer skips merges.txt's first line
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


class ExportError(UserError):
    """A flag, a folder or a missing package that stops the export: one line that says what to do."""


TEMPORARY = re.compile(r"(.+)\.\d+\.tmp")   # formats.temporary_path's names


def check_out(out):
    """--out, a folder that can be written (output_dir), must be new, empty or hold an earlier export: the
    files of another model (a tokenizer.json, say) would be loaded with ours. Returns the files of ours
    that it already holds."""
    if not os.path.exists(output_dir(out)):
        return []
    names = os.listdir(out)
    ours = {name for name in names if (m := TEMPORARY.fullmatch(name)) and m.group(1) in FILES}
    for name in ours:   # an export killed while writing leaves a temporary file of ours behind
        os.remove(os.path.join(out, name))
    others = sorted(name for name in names if name not in FILES and name not in ours)
    if others:
        listed = ", ".join(others[:3]) + (", ..." if others[3:] else "")
        raise ExportError(f"--out {out}: holds other files ({listed}), which would be loaded with the model: "
                          f"name a new or empty folder")
    return sorted(set(names) & set(FILES))


def hf_tensors(config, params, bfloat16=None):
    """model.safetensors' tensors, named as GPT2LMHeadModel.save_pretrained names them ("transformer."
    first, no lm_head.weight: it is wte); in fp32, or in bf16 given ml_dtypes' bfloat16, the numpy type
    safetensors writes."""
    tensors = {}
    for name, (view, transposed) in hf_views(ParamViews(params, config), config).items():
        w = view.T if transposed else view
        if bfloat16 is not None:
            w = formats.float32_to_bf16_bits(w).view(bfloat16)
        tensors[PREFIX + name] = np.ascontiguousarray(w)
    return tensors


def hf_config(config, dtype, eot):
    """config.json: transformers' GPT2Config for our model. llm.c's GELU is the tanh form (gelu_new), its
    layernorm eps 1e-5, and it trains without dropout, so fine-tuning the export starts as we trained."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            **{field: getattr(config, name) for field, name in CONFIG_SIZES.items()},
            "n_head": config.num_heads, "n_ctx": config.max_seq_len,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "initializer_range": 0.02,
            "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True,
            "torch_dtype": DTYPES[dtype]}


def tokenizer_files(tokenizer, max_len):
    """vocab.json, merges.txt and tokenizer_config.json's texts: GPT-2's files, from tiktoken's ranks."""
    spell = byte_to_unicode()
    ranked = tokenizer.token_bytes()[:tokenizer.eot]   # EOT is the one token BPE never makes

    def text(token):
        return "".join(spell[b] for b in token)

    vocab = {text(token): rank for rank, token in enumerate(ranked)} | {ENDOFTEXT: tokenizer.eot}
    merges = recover_merges(ranked)
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_len, "bos_token": ENDOFTEXT,
              "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT, "add_prefix_space": False}
    return {VOCAB: json.dumps(vocab, ensure_ascii=False),
            MERGES: MERGES_HEADER + "".join(f"{text(a)} {text(b)}\n" for a, b in merges),
            TOKENIZER: json.dumps(config, indent=2)}, len(merges)


def write_text(path, text):
    with formats.atomic_write(path) as f:
        f.write(text.encode("utf-8"))


def write_weights(path, tensors, save_file):
    """safetensors' save_file through a temporary name, renamed when complete (formats.atomic_path)."""
    umask = os.umask(0)
    os.umask(umask)
    with formats.atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})   # transformers refuses a file without "format"
        os.chmod(tmp, 0o666 & ~umask)   # safetensors makes it private (0600): the mode of any other new file


def push(out, repo, hub):
    """Upload the folder to the Hub as the model repo `repo` (created if it does not exist)."""
    # our one line, not a warning per retry
    optional("huggingface_hub.utils.logging", "weights").set_verbosity_error()
    print(f"uploading {out} to https://huggingface.co/{repo}")
    try:
        api = hub.HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(folder_path=out, repo_id=repo, commit_message="Export from llm.c's format")
    except Exception as e:   # offline, not logged in: the errors differ by huggingface_hub version
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(f"cannot upload to {repo} ({reason}): the export in {out} is complete; "
                          f"upload it later with: hf upload {repo} {out}") from None


def arguments():
    parser = Parser(description="Write a checkpoint as a Hugging Face model "
                    "folder (model.safetensors, config.json, GPT-2's tokenizer files), for transformers and "
                    "lm-evaluation-harness.")
    parser.add_argument("-e", required=True, metavar="MODEL",
                        help="model checkpoint .bin (ours or llm.c's, v3 fp32 or v5 bf16), or a run's -o "
                             "directory: its newest complete checkpoint")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new, empty, or an "
                        "earlier export, whose files are replaced)")
    parser.add_argument("--dtype", choices=DTYPES, help="precision of model.safetensors (default: the "
                        "checkpoint's own, fp32 for version 3 and bf16 for version 5)")
    parser.add_argument("--vocab", metavar="PATH", help="GPT-2's BPE ranks, a gpt2.tiktoken file "
                        "(default: $GPT2_VOCAB, else tiktoken's download)")
    parser.add_argument("--push", metavar="USER/REPO", help="then upload the folder to the Hugging Face Hub "
                        f"(needs huggingface_hub, {install('weights')}, and a login: hf auth login)")
    return parser


def main(argv):
    args = arguments().parse_args(argv)
    if args.push and not REPO_ID.fullmatch(args.push):
        raise ExportError(f"--push {args.push}: name the Hub repo as USER/REPO")
    # the packages before the work, not after it
    save_file = optional("safetensors.numpy", "weights").save_file
    hub = optional("huggingface_hub", "weights") if args.push else None
    replaced = check_out(args.out)
    path = find_model(args.e)
    config, version = formats.read_model_config(path)   # the header: what the model is, before any large read
    if config.vocab_size != GPT2_VOCAB:
        raise ExportError(f"{path}: vocab_size {config.vocab_size}, but the tokenizer files are GPT-2's, "
                          f"with {GPT2_VOCAB} tokens")
    dtype = args.dtype or formats.MODEL_VERSIONS[version]
    bfloat16 = optional("ml_dtypes", "weights").bfloat16 if dtype == "bf16" else None
    tokenizer = Tokenizer(args.vocab)
    _, params, _ = formats.read_model(path)
    tensors = hf_tensors(config, params, bfloat16)
    print(f"{path} (version {version}, {formats.MODEL_VERSIONS[version]}): L={config.num_layers}, "
          f"C={config.channels}, NH={config.num_heads}, maxT={config.max_seq_len}, V={config.vocab_size}")
    if replaced:
        print(f"replacing the earlier export's {', '.join(replaced)} in {args.out}")
    texts, num_merges = tokenizer_files(tokenizer, config.max_seq_len)
    texts[CONFIG] = json.dumps(hf_config(config, dtype, tokenizer.eot), indent=2)
    texts[GENERATION] = json.dumps({"bos_token_id": tokenizer.eot, "eos_token_id": tokenizer.eot}, indent=2)
    try:
        os.makedirs(args.out, exist_ok=True)
        print(f"writing {os.path.join(args.out, WEIGHTS)}: {sum(w.size for w in tensors.values()):,} "
              f"parameters in {dtype} (wte's {config.vocab_size:,} rows, the lm_head tied to them)")
        write_weights(os.path.join(args.out, WEIGHTS), tensors, save_file)
        print(f"writing {CONFIG}, {GENERATION}, {VOCAB}, {MERGES} ({num_merges:,} merges), {TOKENIZER}")
        for name in (CONFIG, GENERATION, VOCAB, MERGES, TOKENIZER):
            write_text(os.path.join(args.out, name), texts[name])
    except OSError as e:
        raise ExportError(f"cannot write {e.filename or args.out} ({e.strerror}): the folder is "
                          f"incomplete") from None
    if args.push:
        push(args.out, args.push, hub)


if __name__ == "__main__":
    run(main)
