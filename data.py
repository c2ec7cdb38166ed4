"""Reading prepared datasets (format: prepare/common.py) into (x, y) training batches.

Sampling is stateless: the global batch of iteration `it` is drawn from numpy's generator seeded
with (seed, it), and DDP rank r takes its own slice of it. So the data position of a run is just its
iteration number (resume is exact), and N ranks with gradient accumulation A/N see the same global
batch as one process with accumulation A.

Packed documents (train.py's attn_mask_type='block_causal', issue 58): a Dataset opened with documents=True
serves (x, y, document_ids) batches, document_ids (B, T) int32 numbering the documents of each row from 0
(window_document_ids: from the offsets meta.json declares under "documents"; prepare/common.py's format).
A dataset prepared without them is one document per split, with a one-line warning.

Under block_causal the last token of each document still has a target: the next document's first token, which it
is trained to predict from its own document alone (nothing of the next one is visible to it). With
mask_boundary_targets=True (train.py's mask_document_boundary_targets) those targets are -1, left out of the loss
(training and evaluation alike), as packers that drop cross-document targets do.
"""

import json
import os
import sys

import numpy as np
import torch

# datasets whose folder is not named after their prepare script: the command that builds them
PREPARE_COMMANDS = {
    "jsb_music21": "python prepare/jsb.py --source music21",
    "genome_klebsiella": "python prepare/genome.py --source kleborate-examples",
    "shakespeare_char_copyrand32": "python prepare/shakespeare_copymix.py --p_random=1 --min_span=4 --max_span=32",
}


LOSS_MODES = ("all", "last", "after_sep")  # meta.json "loss" (prepare/common.py)


class Dataset:
    """A prepared dataset folder: meta.json plus one memmapped .bin per split, and the batches a
    run draws from it.

    The batch readers (train_batch, fixed_batches, full_split_batches) use the sizes given here once:
    batch_size examples per micro-batch, block_size tokens of context, grad_accum micro-steps per
    process and step, the data seed, and this process's rank among world_size DDP processes.
    Reading arrays and meta needs none of them. Raises FileNotFoundError naming the prepare command
    when the folder or a split is missing, and ValueError if a split is empty (data prepared before
    the prepare scripts refused that) or if rows would not fit block_size. documents=True: stream batches carry
    their document ids (block_causal); mask_boundary_targets=True (with documents): the targets that start a new
    document are -1 (the module docstring).
    """

    def __init__(
        self,
        data_dir,
        *,
        batch_size=None,
        block_size=None,
        grad_accum=1,
        seed=0,
        rank=0,
        world_size=1,
        prepare_hint=None,
        documents=False,
        mask_boundary_targets=False,
    ):
        self.dir, self.documents, self.mask_boundary_targets = data_dir, documents, documents and mask_boundary_targets
        self.batch_size, self.block_size, self.grad_accum = batch_size, block_size, grad_accum
        self.seed, self.rank, self.world_size = seed, rank, world_size
        path = os.path.join(data_dir, "meta.json")
        if not os.path.exists(path):
            name = os.path.basename(os.path.normpath(data_dir))
            cmd = PREPARE_COMMANDS.get(name, f"python prepare/{_script_and_flags(name)}")
            hint = prepare_hint or f"{cmd} --out_dir={data_dir}"
            raise FileNotFoundError(f"no prepared dataset at {data_dir} (meta.json missing). Run: {hint}")
        with open(path) as f:
            self.meta = json.load(f)
        empty = [name for name, s in self.meta["splits"].items() if int(np.prod(s["shape"])) == 0]
        if empty:  # written before the prepare scripts refused empty splits
            raise ValueError(
                f"{data_dir}: split {', '.join(map(repr, empty))} is empty (0 rows or tokens); delete "
                "the folder and prepare it again: the prepare script now stops and names the fix "
                "(e.g. --split fraction for a genome FASTA without chromosomes 21 and 22)"
            )
        self.layout, self.loss = self.meta["layout"], self.meta.get("loss", "all")
        if self.loss not in LOSS_MODES:
            raise ValueError(
                f"{data_dir}/meta.json: loss {self.loss!r} is not one of {LOSS_MODES}; prepare the "
                "data again with this repo's prepare script"
            )
        self.loss_sep = self.meta.get("loss_sep") if self.loss == "after_sep" else None
        self.pad_id = self.meta.get("pad_id")
        self.vocab_size = self.meta["vocab_size"]
        self._arrays, self._offsets = {}, {}
        if documents and "documents" not in self.meta and rank == 0:
            print(
                f"warning: {data_dir} records no document boundaries (prepared before they were): block_causal "
                "treats each split as one document; delete the folder and prepare it again to mask between documents",
                file=sys.stderr,
            )
        if self.layout == "rows" and block_size is not None:
            row_len = self.meta["splits"][next(iter(self.meta["splits"]))]["shape"][1]
            if row_len - 1 > block_size:
                raise ValueError(f"{self.dir} has rows of {row_len} tokens: set block_size >= {row_len - 1}")

    def has_split(self, split):
        return split in self.meta["splits"]

    def array(self, split):
        """The split as a read-only np.memmap: 1-D (stream) or (n_rows, row_len) (rows)."""
        if split not in self._arrays:
            if not self.has_split(split):
                raise KeyError(f"{self.dir} has no split {split!r}; it has {sorted(self.meta['splits'])}")
            s = self.meta["splits"][split]
            self._arrays[split] = np.memmap(
                os.path.join(self.dir, s["file"]), dtype=self.meta["dtype"], mode="r", shape=tuple(s["shape"])
            )
        return self._arrays[split]

    def offsets(self, split):
        """The split's document offsets (int64, n_docs + 1, from 0 to the split's length; meta.json "documents"):
        document i is tokens off[i]:off[i + 1] of a stream, rows off[i]:off[i + 1] of a rows split. A split
        without them: [0, length], one document. FileNotFoundError (what to do) if meta.json names a missing file."""
        if split not in self._offsets:
            docs = self.meta.get("documents", {}).get(split)
            n = self.meta["splits"][split]["shape"][0]
            if docs is None:
                self._offsets[split] = np.array([0, n], dtype=np.int64)
            else:
                path = os.path.join(self.dir, docs["file"])
                if not os.path.exists(path):
                    raise FileNotFoundError(
                        f"{path} is missing, but {self.dir}/meta.json declares {split}'s document offsets in it: "
                        "delete the folder and prepare the dataset again"
                    )
                self._offsets[split] = np.fromfile(path, dtype=docs["dtype"]).astype(np.int64)
        return self._offsets[split]

    def rows_to_xy(self, rows):
        """Rows of a "rows" dataset, (B, W) token ids -> (x, y) int64 (B, w), w <= W - 1: inputs and
        next-token targets, with padding targets set to -1, and the columns that are padding in every
        row dropped (no pad_id: x, y as they are). No document ids even with documents=True: a row is one
        document from position 0, so block_causal is causal attention there (the unmasked path). The loss
        mode (meta.json) keeps only some targets:
        'last' the final real token's; 'after_sep' the tokens right after every k-th occurrence of the
        separator id s in the row (loss_sep = {"id": s, "every": k}; e.g. each query's target in an
        indirect-indexing row of several queries). The others are set to -1."""
        rows = torch.from_numpy(rows.astype(np.int64))
        x, y = rows[:, :-1], rows[:, 1:].clone()
        if self.pad_id is None:
            return x.contiguous(), y
        real = (rows != self.pad_id).sum(1)  # rows are right-padded
        y[y == self.pad_id] = -1
        if self.loss == "last":
            last = real - 2  # index in y of the final real token
            keep = torch.full_like(y, -1)
            keep[torch.arange(len(y)), last] = y[torch.arange(len(y)), last]
            y = keep
        elif self.loss == "after_sep":
            is_sep = x == self.loss_sep["id"]  # x[:, p] a separator: y[:, p] is the token after it
            y = torch.where(is_sep & (is_sep.cumsum(1) % self.loss_sep["every"] == 0), y, -1)
        width = max(int(real.max()) - 1, 1)  # drop columns that are padding in every row
        return x[:, :width].contiguous(), y[:, :width].contiguous()

    def _windows_to_xy(self, arr, starts, split, length=None):
        """(x, y) of the windows of `length` (default block_size) predictions starting at `starts`, plus their
        document ids with documents=True; with mask_boundary_targets, y is -1 where the target starts a new
        document (the last token of each document, the window's last included)."""
        length = self.block_size if length is None else length
        w = np.stack([arr[i : i + length + 1] for i in starts]).astype(np.int64)
        w = torch.from_numpy(w)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if not self.documents:
            return x, y
        ids = window_document_ids(self.offsets(split), np.asarray(starts), length + 1)  # the targets' too
        if self.mask_boundary_targets:
            y[ids[:, 1:] != ids[:, :-1]] = -1
        return x, y, ids[:, :-1].contiguous()

    def random_batch(self, split, rng):
        """(x, y) int64 CPU tensors (batch_size, <= block_size) drawn with `rng` (np.random.Generator)."""
        arr, batch_size, block_size = self.array(split), self.batch_size, self.block_size
        if self.layout == "rows":
            return self.rows_to_xy(arr[np.sort(rng.integers(0, len(arr), batch_size))])
        if len(arr) < block_size + 1:
            raise ValueError(f"split {split!r} has {len(arr)} tokens, fewer than block_size + 1 = {block_size + 1}")
        return self._windows_to_xy(arr, rng.integers(0, len(arr) - block_size, batch_size), split)

    def train_batch(self, it, micro_step):
        """Micro-batch `micro_step` (0 .. grad_accum - 1) of this rank at iteration `it` (stateless, see
        the module docstring): (x, y) int64 CPU tensors (batch_size, <= block_size). Raises ValueError if a
        stream's train split is shorter than block_size + 1 tokens.

        The global batch of `it` holds grad_accum * world_size * batch_size examples, identical for any
        world_size at a fixed grad_accum * world_size.
        """
        batch_size, block_size = self.batch_size, self.block_size
        rng = np.random.default_rng([self.seed, it])
        n_chunks = self.grad_accum * self.world_size
        arr = self.array("train")
        chunk = micro_step * self.world_size + self.rank
        if self.layout == "rows":
            idx = rng.integers(0, len(arr), n_chunks * batch_size).reshape(n_chunks, batch_size)[chunk]
            return self.rows_to_xy(arr[np.sort(idx)])
        if len(arr) < block_size + 1:
            raise ValueError(f"split 'train' has {len(arr)} tokens, fewer than block_size + 1 = {block_size + 1}")
        starts = rng.integers(0, len(arr) - block_size, n_chunks * batch_size).reshape(n_chunks, batch_size)
        return self._windows_to_xy(arr, starts[chunk], "train")

    def fixed_batches(self, split, n_batches):
        """This rank's share (batches rank, rank + world_size, ...) of n_batches random batches of
        `split` that are the same on every call (periodic evaluation). They are drawn with (seed, 7919):
        every run of one seed (RoPE and PoPE alike, a resumed run) is evaluated on the same batches, and
        another seed draws others, so a spread over seeds includes which batches chose best.pt."""
        rng = np.random.default_rng([self.seed, 7919])
        return [self.random_batch(split, rng) for _ in range(n_batches)][self.rank :: self.world_size]

    def full_split_batches(self, split):
        """Yield (x, y) covering the whole split once, this rank taking batches rank, rank + world_size, ...

        rows: every row in order. stream: consecutive non-overlapping windows of block_size
        predictions, so every token but the first is predicted exactly once.
        """
        arr, batch_size, block_size = self.array(split), self.batch_size, self.block_size
        if self.layout == "rows":
            starts = range(0, len(arr), batch_size)
            for b, s in enumerate(starts):
                if b % self.world_size == self.rank:
                    yield self.rows_to_xy(np.asarray(arr[s : s + batch_size]))
            return
        n_windows = (len(arr) - 1) // block_size
        tail = (len(arr) - 1) - n_windows * block_size
        starts = [i * block_size for i in range(n_windows)]
        for b, s in enumerate(range(0, len(starts), batch_size)):
            if b % self.world_size == self.rank:
                yield self._windows_to_xy(arr, starts[s : s + batch_size], split)
        if tail and self.rank == 0:  # the last < block_size predictions
            yield self._windows_to_xy(arr, [len(arr) - tail - 1], split, tail)


def window_document_ids(offsets, starts, length):
    """Document ids of windows of a token stream: offsets (n_docs + 1,) int64 document starts (the last = the
    stream's length), starts (B,) window starts, length T -> (B, T) int32, row b numbering the documents of
    tokens starts[b] .. starts[b] + T - 1 from 0: non-decreasing, 0 at the first token. One np.searchsorted
    over the B x T token indices (no loop over tokens)."""
    tokens = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)
    doc = np.searchsorted(offsets, tokens, side="right") - 1
    return torch.from_numpy((doc - doc[:, :1]).astype(np.int32))


def positions_in_documents(document_ids):
    """(B, T) document ids (non-decreasing) -> (B, T) int64 positions restarting at 0 at each document's first
    token (train.py's reset_position_ids). Vectorised on the ids' device: a running max of document starts."""
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return idx - torch.where(new, idx, 0).cummax(dim=1).values


def _script_and_flags(name):
    """'<name>.py', or for an indirect-indexing variant 'indirect_indexing.py --n_letters=16 ...'."""
    if name.startswith("indirect_indexing_"):
        from dataclasses import asdict

        from prepare.indirect_indexing import Variant

        try:
            flags = asdict(Variant.from_name(name))
        except ValueError:
            return f"{name}.py"
        return "indirect_indexing.py " + " ".join(f"--{k}={v}" for k, v in flags.items())
    return f"{name}.py"
