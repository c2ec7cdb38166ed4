"""PG-19 test split -> GPT-2 BPE, one document per book, for the paper's length-extrapolation test
(section 4 and Figure 2: zero-shot perplexity on sequences of 1024..10240 tokens; appendix B.1: the
test split, 100 books, "roughly 7M tokens", from the Hugging Face dataset emozilla/pg19-test).

    python prepare/pg19.py                        # Hugging Face hub, emozilla/pg19-test
    python prepare/pg19.py --input ~/pg19/test/   # books you have: a folder of plain-text books
                                                  # (one .txt per book, sorted by path), or any input
                                                  # prepare.gpt2_bpe.load_documents accepts

Output data/pg19/ (layout 'stream', split 'test' only):
    test.bin        uint16 GPT-2 ids: book_1 EOT book_2 EOT ... (EOT = 50256)
    test.docs.bin   int64 offsets, n_books + 1 entries: book i is test.bin[off[i]:off[i+1]], its last
                    token the EOT; off[0] = 0 and off[-1] = len(test.bin). Declared in meta.json under
                    "documents": {"test": {"file", "dtype", "n_docs"}}.
An evaluator that must not cross book boundaries reads windows inside [off[i], off[i+1]).
Books are encoded in parallel worker processes, one book per task.
"""

import json
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

HF_NAME = "emozilla/pg19-test"
DOCS_FILE = "test.docs.bin"


def load_hub(name=HF_NAME):
    """The hub dataset's 'test' split (or its only split) with a 'text' column; RuntimeError with the
    fix if the hub is unreachable."""
    import datasets

    try:
        dd = datasets.load_dataset(name)  # emozilla/pg19-test: one split of 100 books
        ds = dd["test"] if "test" in dd else next(iter(dd.values())) if len(dd) == 1 else None
        if ds is None:
            raise ValueError(f"splits {list(dd)}, none is 'test'")
        return ds.select_columns(["text"])
    except Exception as e:
        raise RuntimeError(
            f"could not load {name!r} from the Hugging Face hub ({type(e).__name__}: "
            f"{str(e)[:300]}). Without the hub, pass --input DIR: a folder of the PG-19 test "
            f"books as .txt files (or that dataset saved with save_to_disk / as parquet)."
        ) from e


def read_offsets(out_dir):
    """int64 array of n_docs + 1 book offsets into test.bin (see the module docstring)."""
    return np.fromfile(os.path.join(out_dir, DOCS_FILE), dtype=np.int64)


def complete(out_dir):
    """is_complete for split 'test' plus a test.docs.bin consistent with meta.json and test.bin."""
    if not is_complete(out_dir, splits=("test",)):
        return False
    with open(os.path.join(out_dir, "meta.json")) as f:
        meta = json.load(f)
    docs = meta.get("documents", {}).get("test")
    path = os.path.join(out_dir, DOCS_FILE)
    if not docs or not os.path.exists(path) or os.path.getsize(path) != 8 * (docs["n_docs"] + 1):
        return False
    off = read_offsets(out_dir)
    return bool(off[0] == 0 and off[-1] == meta["splits"]["test"]["tokens"] and np.all(np.diff(off) > 0))


def prepare(out_dir="data/pg19", input=None, num_proc=None, hf_name=HF_NAME):
    """Write test.bin, test.docs.bin and meta.json to out_dir (skipped if already complete). Returns out_dir.
    input: a folder of .txt books (or other load_documents input); None loads `hf_name` from the hub."""
    if complete(out_dir):
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    num_proc = num_proc or os.cpu_count() or 1
    tokenizer = gpt2_tokenizer_meta()
    ds = load_documents(input, prefer_split="test") if input else load_hub(hf_name)
    lengths = []
    with BinWriter(os.path.join(out_dir, "test.bin"), np.uint16) as w:
        for ids, doc_lengths in encode_chunks(ds, range_chunks(0, len(ds), 1), num_proc, desc="encoding books"):
            w.write(ids)
            lengths.extend(doc_lengths.tolist())
    if not lengths:
        raise ValueError(f"no books found in {input or hf_name}")
    documents = write_documents(
        out_dir, {"test": document_offsets(lengths)}, "tokens", "book i = test.bin[off[i]:off[i+1]], ending with EOT"
    )
    write_meta(
        out_dir,
        {
            "dataset": "pg19",
            "vocab_size": N_VOCAB,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {"test": {"file": "test.bin", "shape": [w.count], "tokens": w.count}},
            "pad_id": None,
            "loss": "all",
            "tokenizer": tokenizer,
            "source": os.path.abspath(input) if input else f"hf:{hf_name}",
            "documents": documents,
        },
        "give --input a folder holding non-empty .txt books",
    )
    summarize(out_dir)
    print(f"  {len(lengths)} books, {min(lengths):,} to {max(lengths):,} tokens each")
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, "data/pg19", "folder of .txt books (see above); default: the HF hub", num_proc=True)
    p.add_argument("--hf_name", default=HF_NAME)
    run_cli(prepare, p)
