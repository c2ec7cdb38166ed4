"""Complete prompts with a trained checkpoint.

    python sample.py --start="Ham." --max_new_tokens=300           # train.py's default run (out-shakespeare-char-pope)
    python sample.py --out_dir=out-indirect-pope --start="NZTUIGWkXFrhCJDzscat,N,+4," --max_new_tokens=1 --temperature=0
    python sample.py --out_dir=out-owt-124m-pope --start="FILE:prompt.txt" --num_samples=3
    python sample.py --compile=True      # decode with a compiled step (the default on CUDA: CUDA graphs too)

Loads out_dir/best.pt (or --ckpt=ckpt.pt) with torch.load(weights_only=True) through checkpoint.py,
and decodes with the tokenizer stored in the checkpoint (older checkpoints: the dataset's meta.json).
Character-level and GPT-2 BPE decode to text; other tokenizers print token ids, and their prompts
are given as ids: --start="[1, 2, 3]".
"""

import os
import sys

import torch

from checkpoint import load_codec, load_run, tokenizer_from_checkpoint
from cli import UserError, autocast_context, exit_on_user_error, resolve_compile, resolve_device, resolve_dtype
from configurator import configure

DEFAULTS = dict(
    out_dir="out-shakespeare-char-pope",  # train.py's default run
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
    compile=None,  # decode with a compiled static-shape step (model.generate(compile=True)); None: on for CUDA
)


def complete(
    model,
    encode,
    decode,
    prompt,
    max_new_tokens=DEFAULTS["max_new_tokens"],
    temperature=DEFAULTS["temperature"],
    top_k=DEFAULTS["top_k"],
    num_samples=1,
    seed=DEFAULTS["seed"],
    device="cpu",
    autocast=None,
    compile=False,
):
    """num_samples continuations of the text `prompt` by max_new_tokens tokens each, prompt included, as
    strings: encode -> model.generate (KV cache) -> decode, under `autocast` (a context manager; default:
    cli.autocast_context with the device's automatic dtype, bf16 on CUDA where supported, fp32 on CPU). torch's
    RNG is seeded with `seed`; temperature 0 is greedy, top_k 0 or None keeps every token. Used by main and by
    train.py's end-of-run sample. compile: model.generate's (a compiled decoding step; CUDA graphs on CUDA).
    Raises ValueError for a prompt outside the vocabulary or empty, an
    absolute encoding asked past block_size, num_samples < 1, max_new_tokens < 0 or top_k < 0."""
    if num_samples < 1 or max_new_tokens < 0 or (top_k or 0) < 0:
        raise ValueError(
            f"need num_samples >= 1, max_new_tokens >= 0 and top_k >= 0 (0: every token), got "
            f"{num_samples}, {max_new_tokens} and {top_k}"
        )
    ids = encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty: give --start at least one token")
    torch.manual_seed(seed)
    x = torch.tensor(ids, dtype=torch.long, device=device)[None].repeat(num_samples, 1)
    ctx = autocast if autocast is not None else autocast_context(device, resolve_dtype("auto", device))
    with torch.no_grad(), ctx:
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or None, compile=compile)
    return [decode(row.tolist()) for row in y]


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
        try:
            with open(start[5:], encoding="utf-8") as f:
                start = f.read()
        except (OSError, UnicodeDecodeError) as e:  # missing, unreadable, or not UTF-8 text
            raise UserError(
                f"cannot read the prompt file {start[5:]!r} as UTF-8 text ({getattr(e, 'strerror', None) or e})"
            ) from None
    try:
        outputs = complete(
            model,
            encode,
            decode,
            start,
            cfg["max_new_tokens"],
            cfg["temperature"],
            cfg["top_k"],
            cfg["num_samples"],
            cfg["seed"],
            dev,
            ctx,
            compile=resolve_compile(cfg["compile"], dev),
        )
    except ValueError as e:  # a prompt outside the vocabulary, an absolute position embedding past block_size
        raise UserError(str(e)) from None
    for text in outputs:
        print(text)
        print("---------------")
    return outputs


if __name__ == "__main__":
    main(sys.argv[1:])
