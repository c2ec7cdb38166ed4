"""Complete prompts with a trained checkpoint.

    python sample.py --out_dir=out-indirect --start="NZTUIGWkXFrhCJDzscat,N,+4," --max_new_tokens=1 --temperature=0
    python sample.py --out_dir=out-owt-124m-pope --start="FILE:prompt.txt" --num_samples=3

Loads out_dir/best.pt (or --ckpt=ckpt.pt) with torch.load(weights_only=True) and decodes with the
tokenizer recorded in the dataset's meta.json (character-level or GPT-2 BPE; other tokenizers
print token ids, and their prompts are given as ids: --start="[1, 2, 3]").
"""

import ast
import json
import os
import sys

import torch

from configurator import configure
from model import GPT, GPTConfig

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
    attn_backend="auto",
)


def load_codec(meta):
    """(encode, decode) for meta['tokenizer']: str -> list[int] and list[int] -> str."""
    tok = meta.get("tokenizer", {})
    if tok.get("kind") == "char":
        itos = tok["itos"]
        stoi = {s: i for i, s in enumerate(itos)}
        pad = meta.get("pad_id")

        def encode(text):
            missing = sorted(set(text) - set(stoi))
            if missing:
                raise ValueError(f"characters {missing} are not in this dataset's vocabulary {''.join(itos)!r}")
            return [stoi[c] for c in text]
        return encode, lambda ids: "".join(itos[i] for i in ids if i != pad and i < len(itos))
    if tok.get("kind") == "gpt2":
        from prepare.gpt2_bpe import gpt2_encoding
        enc = gpt2_encoding()
        return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode
    return (lambda s: _ids(s)), (lambda ids: " ".join(map(str, ids)))


def _ids(text):
    try:
        ids = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError("this dataset's tokenizer has no text codec here: give the prompt as token ids, e.g. --start='[1, 2, 3]'")
    return ids


def main(argv):
    cfg = configure(DEFAULTS, argv)
    dev = cfg["device"] if cfg["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    path = os.path.join(cfg["out_dir"], cfg["ckpt"])
    if not os.path.exists(path):
        sys.exit(f"error: no checkpoint at {path}; train first (python train.py --out_dir={cfg['out_dir']})")
    ckpt = torch.load(path, map_location=dev, weights_only=True)
    model = GPT(GPTConfig(**{**ckpt["model_args"], "attn_backend": cfg["attn_backend"]}))
    model.load_state_dict(ckpt["model"])
    model.eval().to(dev)
    run_cfg = ckpt["config"]
    with open(os.path.join(run_cfg["data_root"], run_cfg["dataset"], "meta.json")) as f:
        encode, decode = load_codec(json.load(f))
    start = cfg["start"]
    if start.startswith("FILE:"):
        with open(start[5:], encoding="utf-8") as f:
            start = f.read()
    try:
        ids = encode(start)
    except ValueError as e:
        sys.exit(f"error: {e}")
    torch.manual_seed(cfg["seed"])
    x = torch.tensor(ids, dtype=torch.long, device=dev)[None].repeat(cfg["num_samples"], 1)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if dev.startswith("cuda") else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), ctx:
        y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"] or None)
    outputs = [decode(row.tolist()) for row in y]
    for text in outputs:
        print(text)
        print("---------------")
    return outputs


if __name__ == "__main__":
    main(sys.argv[1:])
