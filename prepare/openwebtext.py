"""OpenWebText -> GPT-2 BPE token streams, the paper's language-modelling corpus (appendix B.1: about
9B train and 4M validation tokens, GPT-2 tokenizer with 50257 ids, context 1024).

    python prepare/openwebtext.py                          # Hugging Face hub, Skylion007/openwebtext
    python prepare/openwebtext.py --input ~/owt_txt/       # files you already have (below)
    python prepare/openwebtext.py --input owt.parquet --num_proc=16 --out_dir=data/openwebtext

--input accepts (prepare.gpt2_bpe.load_documents): a folder (searched recursively) of .txt files, one
document per file, e.g. the original OpenWebText release unpacked; a folder written by
datasets' save_to_disk (its 'train' split); .parquet or .jsonl/.json files with a 'text' column; or a
mix of these in one folder.

Output data/openwebtext/{train,val}.bin (uint16, layout 'stream'): every document is followed by the
end-of-text id 50256; {train,val}.docs.bin: where each document starts (meta.json "documents", for
train.py's attn_mask_type='block_causal'). Split as nanoGPT: the validation documents are the first
ceil(0.0005 * n_docs) of np.random.default_rng(2357).permutation(n_docs), the documents that datasets'
train_test_split(test_size=0.0005, seed=2357) puts in its test split (4,007 of 8,013,769 documents,
about 4.4M tokens); train is all the others in their original order (training takes random crops, so
order is irrelevant; nanoGPT's train is shuffled, same documents). OpenWebText has no test split and
none is made: like the paper (Table 4), report validation perplexity; meta.json lists train and val only.
Disk: about 18 GB for train.bin, plus the hub download/cache (~55 GB) when --input is not given.
"""

import math
import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare.common import (
    BinWriter,
    arg_parser,
    document_offsets,
    is_complete,
    run_cli,
    summarize,
    write_documents,
    write_meta,
)
from prepare.gpt2_bpe import N_VOCAB, encode_chunks, gpt2_tokenizer_meta, load_documents, range_chunks

HF_NAME = "Skylion007/openwebtext"
SPLITS = ("train", "val")


def load_hub(name=HF_NAME, num_proc=None):
    """The hub dataset's 'train' split as a Dataset with a 'text' column; RuntimeError with the fix if
    the hub is unreachable or datasets refuses the repository."""
    import datasets

    try:
        return datasets.load_dataset(name, split="train", num_proc=num_proc).select_columns(["text"])
    except Exception as e:
        raise RuntimeError(
            f"could not load {name!r} from the Hugging Face hub ({type(e).__name__}: {str(e)[:300]}). "
            "Without the hub, get OpenWebText elsewhere (the original release unpacked to .txt files, or the "
            "dataset saved with save_to_disk or as parquet/jsonl) and pass --input PATH. If the error says "
            "dataset scripts are no longer supported, either pass --input or use `pip install 'datasets<4'`."
        ) from e


def split_indices(n_docs, val_fraction=0.0005, seed=2357):
    """(val, is_val): sorted int64 indices of the validation documents and a bool mask over all n_docs.
    Same documents as datasets' train_test_split(test_size=val_fraction, seed=seed)['test']."""
    n_val = math.ceil(val_fraction * n_docs)
    if not 1 <= n_val < n_docs:
        raise ValueError(
            f"{n_docs} documents with val_fraction {val_fraction} leave {n_val} for val; "
            f"need at least 1 val and 1 train document"
        )
    val = np.sort(np.random.default_rng(seed).permutation(n_docs)[:n_val])
    is_val = np.zeros(n_docs, dtype=bool)
    is_val[val] = True
    return val, is_val


def train_chunks(n_docs, is_val, size):
    """Chunks of at most `size` train rows: a (start, stop) range where no val document falls inside
    (fast contiguous reads), else the array of its train row indices."""
    chunks = []
    for a, b in range_chunks(0, n_docs, size):
        if is_val[a:b].any():
            rows = np.flatnonzero(~is_val[a:b]) + a
            if len(rows):
                chunks.append(rows)
        else:
            chunks.append((a, b))
    return chunks


def prepare(
    out_dir="data/openwebtext",
    input=None,
    num_proc=None,
    val_fraction=0.0005,
    seed=2357,
    chunk_docs=1024,
    hf_name=HF_NAME,
):
    """Write train.bin, val.bin and meta.json to out_dir (skipped if already complete). Returns out_dir.

    input: path for load_documents, or None for the hub dataset `hf_name`. num_proc: encoding worker
    processes (default: all cores). Raises RuntimeError/ValueError with the fix on unusable input."""
    if is_complete(out_dir, splits=SPLITS):
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    num_proc = num_proc or os.cpu_count() or 1
    tokenizer = gpt2_tokenizer_meta()
    ds = load_documents(input) if input else load_hub(hf_name, num_proc)
    n_docs = len(ds)
    val, is_val = split_indices(n_docs, val_fraction, seed)
    plan = {
        "val": [val[i : i + chunk_docs] for i in range(0, len(val), chunk_docs)],
        "train": train_chunks(n_docs, is_val, chunk_docs),
    }
    entries, lengths = {}, {}
    for name in ("val", "train"):
        lengths[name] = []
        with BinWriter(os.path.join(out_dir, f"{name}.bin"), np.uint16) as w:
            for ids, doc_lengths in encode_chunks(ds, plan[name], num_proc, desc=f"encoding {name}"):
                w.write(ids)
                lengths[name].append(doc_lengths)
        entries[name] = {"file": f"{name}.bin", "shape": [w.count], "tokens": w.count}
    offsets = {k: document_offsets(np.concatenate(v) if v else []) for k, v in lengths.items()}
    write_meta(
        out_dir,
        {
            "dataset": "openwebtext",
            "vocab_size": N_VOCAB,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {k: entries[k] for k in SPLITS},
            "documents": write_documents(
                out_dir, offsets, "tokens", "document i = tokens off[i]:off[i+1], its text then EOT"
            ),
            "pad_id": None,
            "loss": "all",
            "tokenizer": tokenizer,
            "source": os.path.abspath(input) if input else f"hf:{hf_name}",
            "split": {
                "method": "nanoGPT train_test_split",
                "val_fraction": val_fraction,
                "seed": seed,
                "documents": {"train": int(n_docs - len(val)), "val": int(len(val))},
            },
            "notes": "Each document is followed by EOT (50256). No test split: OpenWebText has none; "
            "report validation perplexity, as the paper does (Table 4).",
        },
        "give --input documents with text, and a --val_fraction that leaves val at least one of them",
    )
    summarize(out_dir)
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, "data/openwebtext", "local documents (see above); default: the HF hub", num_proc=True)
    p.add_argument("--val_fraction", type=float, default=0.0005)
    p.add_argument("--seed", type=int, default=2357)
    p.add_argument("--hf_name", default=HF_NAME)
    run_cli(prepare, p)
