"""Human reference genome (GRCh38) -> Nucleotide Transformer 6-mer tokens, rows of 1 + 1000 tokens.

Paper App. B.1: the HRG dataset of the Nucleotide Transformer (NT; Dalla-Torre et al. 2025), all
autosomes and sex chromosomes of GRCh38 (3.2 Gbases), NT's preprocessing and tokenization, sequences
of up to 1000 tokens, vocabulary 4107.

Source (default). The Hugging Face repository InstaDeepAI/human_reference_genome holds no data, only a loading
script that downloads the NCBI FASTA below; the installed `datasets` (>= 4) no longer runs loading
scripts. So this script reads that FASTA itself (downloaded from URL when --input is absent, or any
local FASTA, plain, .gz or .xz) and applies the same rules as that script:
  - cleaning: upper-case every base (soft-masked lowercase included); any other symbol (IUPAC codes
    R, Y, K, M, ...) becomes N;
  - splits (--split chromosomes, the default): train = chromosomes 1-20, X, Y; val = 21; test = 22;
    other records (mitochondrion, unlocalized/unplaced scaffolds, alt loci, patches) are skipped and
    counted. Headers recognized: NCBI "... Homo sapiens chromosome 7, GRCh38.p14 Primary Assembly",
    and a first word "7" or "chr7". --split fraction (for other FASTAs): each block of block_bp bases
    goes to val or test with probability 5% each, by a hash of (record name, block index);
  - chunks: each chromosome is cut into consecutive 6000-bp chunks (the dataset's "6kbp" config,
    without its 200-bp overlap and random start offset); a chunk of only N (an assembly gap) carries no
    information and is dropped (counted).
Tokenization (NT's NucleotidesKmersTokenizer, k=6, applied to each chunk): split the chunk at every N;
cut each N-free run into non-overlapping 6-mers from its start; the run's last len % 6 bases become
single-nucleotide tokens; every N is its own token. E.g. ACGTACGTACNACG -> ACGTAC G T A C N A C G.
Vocabulary, in NT's order (4107 ids):
    0 <unk>  1 <pad>  2 <mask>  3 <cls>
    4 .. 4099     the 4096 6-mers in itertools.product("ATCG", repeat=6) order (AAAAAA=4, AAAAAT=5, ...)
    4100 A  4101 T  4102 C  4103 G  4104 N
    4105 <eos>  4106 <bos>
Rows: a clean chunk gives exactly 1000 tokens; a row is [<cls>] + 1000 tokens (row_len 1001, so the
model trains with context 1000, predicting 1000 DNA tokens). A chunk holding N gives more than 1000
tokens: the excess starts a second [<cls>]-row; short rows are right-padded with <pad> (1).
Layout 'rows', loss 'all'.

Streaming: the FASTA is read line by line; blocks of block_bp bases (a multiple of 6000) go to a
multiprocessing pool a few at a time, and token rows are appended to the split files as they come
back, so memory holds a few blocks, never the genome or its tokens.

Offline alternative, --source kleborate-examples: a real bacterial genome that a Debian package
ships (`apt-get install kleborate-examples`, the example data of the Kleborate tool; GPL-3+):
/usr/share/doc/kleborate/examples/data/MGH78578.fna.xz, Klebsiella pneumoniae subsp. pneumoniae
MGH 78578 (ATCC 700721; GenBank GCA_000016305.1): the chromosome CP000647.1 (5,315,120 bp) and five
plasmids CP000648-CP000652.1, 5,694,894 bp in all, no N. About 1/550 of the human genome, and a
bacterium, not a human: a miniature of the paper's task, not the HRG dataset. A genome this small
has no chromosomes 21 and 22 to hold out, so this source defaults to --split fraction with
--block_bp 30000: 30-kb blocks drawn by hash into val/test (5% each in expectation; for MGH 78578
12 blocks = 360 kb val, 8 blocks = 240 kb test, 5,094,894 bp train), -> data/genome_klebsiella/.

    python prepare/genome.py --input GCF_000001405.40_GRCh38.p14_genomic.fna.gz     # -> data/genome/
    python prepare/genome.py --source kleborate-examples                           # -> data/genome_klebsiella/
"""

import gzip
import itertools
import lzma
import os
import re
import sys
import time
import zlib
from multiprocessing import Pool

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prepare.common import (
    BinWriter,
    arg_parser,
    check_nonempty,
    document_offsets,
    download,
    is_complete,
    run_cli,
    summarize,
    write_documents,
    write_meta,
)

URL = (
    "https://ftp.ncbi.nlm.nih.gov/genomes/all/GCF/000/001/405/GCF_000001405.40_GRCh38.p14/"
    "GCF_000001405.40_GRCh38.p14_genomic.fna.gz"
)
K = 6
NUCLEOTIDES = "ATCG"  # NT's order; codes 0..3, N is code 4
ITOS = (
    ["<unk>", "<pad>", "<mask>", "<cls>"]
    + ["".join(p) for p in itertools.product(NUCLEOTIDES, repeat=K)]
    + list(NUCLEOTIDES)
    + ["N", "<eos>", "<bos>"]
)
STOI = {s: i for i, s in enumerate(ITOS)}
VOCAB_SIZE = len(ITOS)  # 4107
PAD_ID, CLS_ID, KMER0, NUC0, N_ID = STOI["<pad>"], STOI["<cls>"], STOI["A" * K], STOI["A"], STOI["N"]
CHUNK_BP = 6000
SEQ_TOKENS = 1000
ROW_LEN = SEQ_TOKENS + 1  # <cls> + 1000
TRAIN_CHROMS = {str(i) for i in range(1, 21)} | {"X", "Y"}
SPLIT_OF_CHROM = {**{c: "train" for c in TRAIN_CHROMS}, "21": "val", "22": "test"}
FRACTION = {"val": 0.05, "test": 0.05}
# --source: a FASTA that a Debian package installs -> (path, default out_dir, split, block_bp)
SOURCES = {
    "kleborate-examples": (
        "/usr/share/doc/kleborate/examples/data/MGH78578.fna.xz",
        "data/genome_klebsiella",
        "fraction",
        30_000,
    ),
}

_LUT = np.full(256, 4, dtype=np.uint8)  # byte -> code; everything but A/T/C/G (either case) -> N
for _i, _c in enumerate(NUCLEOTIDES):
    _LUT[ord(_c)] = _LUT[ord(_c.lower())] = _i
_NCBI = re.compile(r"Homo sapiens chromosome (\w+), GRCh38(?:\.p\d+)? Primary Assembly")
_PLAIN = re.compile(r"^(?:chr)?(\d{1,2}|X|Y)$", re.IGNORECASE)


def clean(seq):
    """DNA text or bytes -> uint8 codes (A=0, T=1, C=2, G=3, N=4): upper-cased, other symbols -> N."""
    return _LUT[np.frombuffer(seq.encode() if isinstance(seq, str) else seq, dtype=np.uint8)]


def tokenize(codes):
    """NT 6-mer tokenization of one chunk (see module docstring).

    codes: 1-D uint8 array from clean(). Returns a 1-D int64 array of token ids in 4..4104
    (no <cls>); a clean chunk of 6000 bases gives exactly 1000 ids. Source: NT's
    NucleotidesKmersTokenizer.tokenize (instadeepai/nucleotide-transformer), vectorized."""
    n = codes.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.arange(n)
    is_n = codes == 4
    run_start = np.maximum.accumulate(np.where(is_n, idx, -1)) + 1  # first base after the last N
    run_end = np.minimum.accumulate(np.where(is_n, idx, n)[::-1])[::-1]  # next N (exclusive end)
    pos = idx - run_start
    full = (run_end - run_start) // K * K  # bases of the run covered by whole 6-mers
    kmer_start = ~is_n & (pos % K == 0) & (pos < full)
    single = ~is_n & (pos >= full)
    c = np.concatenate([codes, np.zeros(K - 1, dtype=np.uint8)]).astype(np.int64)
    kval = sum(c[j : j + n] << (2 * (K - 1 - j)) for j in range(K))
    ids = np.where(is_n, N_ID, np.where(kmer_start, KMER0 + kval, NUC0 + c[:n]))
    return ids[is_n | kmer_start | single]


def encode(seq):
    """DNA string -> token ids of one sequence (no <cls>), cleaned then tokenized as one chunk."""
    return tokenize(clean(seq))


def decode(ids):
    """Token ids -> DNA string; special tokens (<cls>, <pad>, ...) are dropped. decode(encode(s)) is
    s upper-cased with non-ACGT symbols as N."""
    return "".join(ITOS[i] for i in np.asarray(ids).tolist() if not ITOS[i].startswith("<"))


def block_rows(block):
    """Bytes of one block (its start aligned to a 6000-bp chunk) -> (rows uint16 (r, 1001), n_tokens,
    n_all_n_chunks_dropped). Each 6000-bp chunk is tokenized on its own."""
    codes = clean(block)
    rows, n_tok, dropped = [], 0, 0
    for s in range(0, codes.size, CHUNK_BP):
        chunk = codes[s : s + CHUNK_BP]
        if (chunk == 4).all():
            dropped += 1
            continue
        ids = tokenize(chunk)
        n_tok += ids.size
        for i in range(0, ids.size, SEQ_TOKENS):
            row = np.full(ROW_LEN, PAD_ID, dtype=np.uint16)
            piece = ids[i : i + SEQ_TOKENS]
            row[0], row[1 : 1 + piece.size] = CLS_ID, piece
            rows.append(row)
    out = np.stack(rows) if rows else np.zeros((0, ROW_LEN), dtype=np.uint16)
    return out, n_tok, dropped


def chromosome(header):
    """FASTA header (without '>') -> '1'..'22', 'X', 'Y', or None if not a primary human chromosome."""
    m = _NCBI.search(header)
    if m:
        name = m.group(1)
    else:
        m = _PLAIN.match(header.split()[0]) if header.split() else None
        name = m.group(1).upper() if m else None
    return name if name in SPLIT_OF_CHROM else None


def iter_blocks(path, block_bp):
    """Stream a FASTA (plain, .gz or .xz) as (record header, block index, bytes of <= block_bp bases)."""
    opener = gzip.open if path.endswith(".gz") else lzma.open if path.endswith(".xz") else open
    header, buf, k = None, bytearray(), 0
    with opener(path, "rb") as f:
        for line in f:
            if line.startswith(b">"):
                if header is not None and buf:
                    yield header, k, bytes(buf)
                header, buf, k = line[1:].decode(errors="replace").strip(), bytearray(), 0
                continue
            if header is None:
                if line.strip():
                    raise ValueError(f"{path} is not FASTA: sequence before the first '>' header line")
                continue
            buf += line.rstrip()
            while len(buf) >= block_bp:  # a long (unwrapped) line may hold several blocks
                yield header, k, bytes(buf[:block_bp])
                del buf[:block_bp]
                k += 1
    if header is not None and buf:
        yield header, k, bytes(buf)


def split_of(header, k, mode):
    """'train' | 'val' | 'test' | None (skip) for block k of a record, under --split mode."""
    if mode == "chromosomes":
        c = chromosome(header)
        return SPLIT_OF_CHROM[c] if c else None
    u = zlib.crc32(f"{header.split()[0] if header.split() else header}:{k}".encode()) / 2**32
    return "val" if u < FRACTION["val"] else "test" if u < FRACTION["val"] + FRACTION["test"] else "train"


def _work(item):
    split, block = item[:2]
    return (split, len(block), *block_rows(block))


EMPTY_FIX = {
    "chromosomes": "use --split fraction (--split chromosomes takes val from chromosome 21 and test from 22, "
    "and train from 1-20/X/Y, so the FASTA must hold all of them)",
    "fraction": "give a longer FASTA or a smaller --block_bp (--split fraction draws val and test as 5 % "
    "of the blocks each)",
}


def source_fasta(source):
    """The FASTA path that the Debian package `source` (a key of SOURCES) installs. Raises
    FileNotFoundError naming `apt-get install PKG` when the file is missing."""
    path = SOURCES[source][0]
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: install the Debian package with `apt-get install {source}` "
            "(if it is installed, dpkg may exclude /usr/share/doc: then `apt-get download "
            f"{source}`, `dpkg -x` the .deb and pass --input {os.path.basename(path)})"
        )
    return path


def prepare(out_dir=None, input=None, split=None, block_bp=None, num_proc=None, source=None):
    """Tokenize a FASTA into train/val/test rows of 1001 tokens + meta.json (skipped if complete).
    Returns out_dir. input: a FASTA (default: GRCh38, downloaded); source: a key of SOURCES instead
    (its installed FASTA, out_dir, split and block_bp are the defaults). split defaults to
    'chromosomes', block_bp to 600,000 bp. Raises ValueError on a block_bp that is not a positive
    multiple of 6000, a bad split mode or source,
    or if no record fits the split (e.g. a non-human FASTA under --split chromosomes: use --split
    fraction); FileNotFoundError if the source's package is not installed."""
    if block_bp is not None and (block_bp <= 0 or block_bp % CHUNK_BP):  # <= 0: no block would ever fill
        raise ValueError(f"block_bp must be a positive multiple of {CHUNK_BP}, got {block_bp}")
    if source is not None:
        if input is not None:
            raise ValueError("give --input or --source, not both")
        if source not in SOURCES:
            raise ValueError(f"--source must be one of {sorted(SOURCES)}, got {source!r}")
        _, src_out, src_split, src_block = SOURCES[source]
        out_dir, split, block_bp = out_dir or src_out, split or src_split, block_bp or src_block
    out_dir, split, block_bp = out_dir or "data/genome", split or "chromosomes", block_bp or 600_000
    if is_complete(out_dir):
        print(f"{out_dir} is complete; nothing to do")
        return out_dir
    if split not in ("chromosomes", "fraction"):
        raise ValueError(f"split must be 'chromosomes' or 'fraction', got {split!r}")
    if source is not None:
        input = source_fasta(source)
    elif input is None:
        input = download(
            URL,
            os.path.join(out_dir, "raw", os.path.basename(URL)),
            "download the GRCh38 FASTA elsewhere and pass --input PATH (.fa/.fna/.fasta, optionally .gz)",
        )
    t0 = time.time()
    nproc = num_proc or os.cpu_count()
    names = ("train", "val", "test")
    rows_n, toks, bases, records = (dict.fromkeys(names, 0) for _ in range(4))
    skipped, dropped = {}, 0

    def jobs():  # (split, block) for the blocks we keep; skipped records are counted
        for header, k, block in iter_blocks(input, block_bp):
            s = split_of(header, k, split)
            if s is None:
                skipped[header] = skipped.get(header, 0) + len(block)
                continue
            if k == 0:
                records[s] += 1
            yield s, block, header, k

    with (
        BinWriter(os.path.join(out_dir, "train.bin"), np.uint16) as wtr,
        BinWriter(os.path.join(out_dir, "val.bin"), np.uint16) as wva,
        BinWriter(os.path.join(out_dir, "test.bin"), np.uint16) as wte,
        Pool(nproc) as pool,
        tqdm(unit="bp", unit_scale=True, desc="genome") as bar,
    ):
        writers = {"train": wtr, "val": wva, "test": wte}
        doc_rows = {s: [] for s in names}  # rows of each document: a run of consecutive blocks of one record
        last = dict.fromkeys(names)  # (header, k) of the split's last block with rows
        it = jobs()
        while True:
            batch = list(itertools.islice(it, 4 * nproc))  # bounded: a few blocks in flight
            if not batch:
                break
            for (_, _, header, k), (s, n_bp, rows, n_tok, n_drop) in zip(batch, pool.map(_work, batch)):
                if len(rows):
                    if last[s] == (header, k - 1):
                        doc_rows[s][-1] += len(rows)
                    else:
                        doc_rows[s].append(len(rows))
                    last[s] = (header, k)
                writers[s].write(rows)
                rows_n[s] += len(rows)
                toks[s] += n_tok
                bases[s] += n_bp
                dropped += n_drop
                bar.update(n_bp)
        if not any(rows_n.values()):
            raise ValueError(
                f"no record of {input} fits --split {split}: headers name no human chromosome "
                "1-22/X/Y (NCBI, 'chr7' or '7'); use --split fraction for other FASTAs"
            )
        check_nonempty(rows_n, EMPTY_FIX[split], f"{input} under --split {split}")  # before any file is kept
    seconds = time.time() - t0
    n_tok, n_bp = sum(toks.values()), sum(bases.values())
    write_meta(
        out_dir,
        {
            "dataset": "genome",
            "vocab_size": VOCAB_SIZE,
            "dtype": "uint16",
            "layout": "rows",
            "pad_id": PAD_ID,
            "loss": "all",
            "cls_id": CLS_ID,
            "documents": write_documents(
                out_dir,
                {s: document_offsets(n) for s, n in doc_rows.items()},
                "rows",
                "one document per record (contig), or per run of its consecutive blocks in the split: rows "
                "off[i]:off[i+1]",
            ),
            "splits": {
                s: {"file": f"{s}.bin", "shape": [rows_n[s], ROW_LEN], "tokens": toks[s] + rows_n[s]} for s in names
            },
            "tokenizer": {"kind": "nucleotide_transformer_6mer", "k": K, "itos": ITOS},
            "source": os.path.basename(input),
            "package": source,
            "split": split,
            "block_bp": block_bp,
            "chunk_bp": CHUNK_BP,
            "row_len": ROW_LEN,
            "records": records,
            "bases": bases,
            "dna_tokens": toks,
            "all_n_chunks_dropped": dropped,
            "skipped_records": len(skipped),
            "skipped_bases": sum(skipped.values()),
            "skipped_record_names": sorted(skipped)[:200],
            "throughput": {
                "seconds": round(seconds, 3),
                "bases_per_sec": round(n_bp / max(seconds, 1e-9)),
                "tokens_per_sec": round(n_tok / max(seconds, 1e-9)),
            },
        },
        EMPTY_FIX[split],
    )
    summarize(out_dir)
    print(f"skipped {len(skipped)} records ({sum(skipped.values()):,} bp), dropped {dropped} all-N chunks")
    print(f"throughput: {n_bp:,} bp -> {n_tok:,} tokens in {seconds:.1f} s = {n_bp / max(seconds, 1e-9):,.0f} bp/s")
    return out_dir


if __name__ == "__main__":
    p = arg_parser(__doc__, None, "FASTA, plain, .gz or .xz (default: download URL)", num_proc=True)
    p.add_argument(
        "--source",
        choices=sorted(SOURCES),
        default=None,
        help="a FASTA that this Debian package installs, instead of --input",
    )
    p.add_argument(
        "--split", choices=["chromosomes", "fraction"], default=None, help="default: chromosomes (--source: fraction)"
    )
    p.add_argument("--block_bp", type=int, default=None, help="default: 600000 (--source: 30000)")
    run_cli(prepare, p)
