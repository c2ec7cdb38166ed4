"""Complete prompts with a trained checkpoint.

    python sample.py --out_dir=out-indirect --start="NZTUIGWkXFrhCJDzscat,N,+4," --max_new_tokens=1 --temperature=0
    python sample.py --out_dir=out-owt-124m-pope --start="FILE:prompt.txt" --num_samples=3

Loads out_dir/best.pt (or --ckpt=ckpt.pt) with torch.load(weights_only=True) through checkpoint.py,
and decodes with the tokenizer stored in the checkpoint (older checkpoints: the dataset's meta.json).
Character-level and GPT-2 BPE decode to text; other tokenizers print token ids, and their prompts
are given as ids: --start="[1, 2, 3]".
"""

import os
import sys

import torch

from checkpoint import load_codec, load_run, tokenizer_from_checkpoint
from cli import UserError, autocast_context, exit_on_user_error, resolve_device, resolve_dtype
from configurator import configure

DEFAULTS = dict(
    out_dir="out-indirect",
    ckpt="best.pt",  # 'best.pt' (best val loss) or 'ckpt.pt' (latest)
    start="\n",  # prompt text, "FILE:path" to read it from a file, or a list of ids "[1, 2]"
    num_samples=1,
    max_new_tokens=200,
    temperature=0.8,  # 0 picks the most likely token
    top_k=200,
    seed=1337,
    device="auto",
    dtype="auto",  # 'auto' (float32 on CPU; bf16 on CUDA if supported, else fp16) | 'float32' | 'bfloat16' | 'float16'
    attn_backend="auto",
)


@exit_on_user_error
def main(argv):
    cfg = configure(DEFAULTS, argv)
    dev = resolve_device(cfg["device"])
    ctx = autocast_context(dev, resolve_dtype(cfg["dtype"], dev))
    model, state = load_run(cfg["out_dir"], cfg["ckpt"], dev, attn_backend=cfg["attn_backend"])
    tokenizer = tokenizer_from_checkpoint(state, source=os.path.join(cfg["out_dir"], cfg["ckpt"]))
    encode, decode = load_codec(tokenizer)
    start = cfg["start"]
    if start.startswith("FILE:"):
        with open(start[5:], encoding="utf-8") as f:
            start = f.read()
    try:
        ids = encode(start)
    except ValueError as e:
        raise UserError(str(e)) from None
    torch.manual_seed(cfg["seed"])
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None].repeat(cfg["num_samples"], 1)
    try:
        with torch.no_grad(), ctx:
            y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"] or None)
    except ValueError as e:  # e.g. an absolute position embedding asked past block_size
        raise UserError(str(e)) from None
    outputs = [decode(row.tolist()) for row in y]
    for text in outputs:
        print(text)
        print("---------------")
    return outputs


if __name__ == "__main__":
    main(sys.argv[1:])
