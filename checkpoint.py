"""Run folders: the checkpoint format, written by train.py and read by every other script.

A run folder (train.py's out_dir) holds two checkpoints, both written atomically (cli.atomic_open):

    ckpt.pt   the latest state, for init_from='resume': CKPT_KEYS
    best.pt   the weights of the best val loss, for evaluation, sampling and fine-tuning: BEST_KEYS

    model          the GPT's state_dict
    model_args     GPTConfig's fields (an old field name, model.RENAMED_FIELDS, is read as the new one)
    config         every train.py setting of the run
    iter_num       optimizer steps done when it was written
    best_val_loss  the best val loss (nats, fixed batches) so far
    tokenizer      the dataset's meta.json entries that decoding needs ({"dataset", "vocab_size",
                   "pad_id", "tokenizer"}, tokenizer_to_checkpoint), so that a folder copied to another
                   machine samples and evaluates without the dataset folder; older checkpoints fall
                   back to <data_root>/<dataset>/meta.json (tokenizer_from_checkpoint)
    provenance     where the run came from, one entry per process that trained it, oldest first
                   (provenance.py: commit, libraries, machine, data fingerprint); absent in older ones
    optimizer, scaler, rng, data_position   ckpt.pt only: AdamW's and the GradScaler's state, every
                   process's torch RNG states, and {"seed", "iter_num"} (batches are drawn from both)

save_checkpoint writes them; load_checkpoint / load_run read them (sample.py, eval_extrapolate.py,
study/eval_downstream.py, study/analyze.py, train.py's resume); load_finetune_checkpoint checks a checkpoint
against a fine-tune's settings (FINETUNE_FREE). One file defines the format, not a copy per script.

checkpoint_format='dcp' (an FSDP run) writes folders ckpt.dcp and best.dcp instead (sharding.py); dcp_path names
them and convert_hint gives the command that turns one into a file.
"""

import ast
import json
import os
import tempfile
from dataclasses import asdict

import torch

from cli import UserError, atomic_open
from model import GPT, RENAMED_FIELDS, GPTConfig

TOKENIZER_KEYS = ("dataset", "vocab_size", "pad_id", "tokenizer")
BEST_KEYS = ("model", "model_args", "config", "iter_num", "best_val_loss", "tokenizer", "provenance")
CKPT_KEYS = BEST_KEYS + ("optimizer", "scaler", "rng", "data_position")
DROPE = ("rope", "none")  # the one change of encoding a fine-tune may make: DroPE (Gelberg et al. 2025)
FINETUNE_FREE = (
    "block_size",
    "rope_scaling",
    "rope_original_block_size",
    "dropout",
    "attn_backend",
    "pope_delta_init",
    "rope_yarn_ramp",
)  # what a fine-tune may change (delta's init is moot once weights load)
LEGACY_MODEL_ARGS = {"rope_yarn_ramp": "paper"}  # a field added later -> its value in checkpoints without it
DCP_SUFFIX = ".dcp"  # ckpt.dcp, best.dcp: the sharded twins of ckpt.pt and best.pt (checkpoint_format='dcp')


def save_checkpoint(
    out_dir,
    *,
    model,
    optimizer,
    scaler,
    model_args,
    config,
    iter_num,
    best_val_loss,
    rng,
    tokenizer,
    best,
    provenance=(),
):
    """Write out_dir/ckpt.pt (CKPT_KEYS) and, if best, out_dir/best.pt (BEST_KEYS) first, each atomically.

    model: the GPT (not its compiled or DDP wrapper); optimizer, scaler: their state_dicts are saved (model and
    optimizer may be given as state dicts already, e.g. gathered from FSDP's shards: train.save_run);
    model_args: asdict(GPTConfig); config: the run's settings (a dict with 'seed'); rng: every
    process's RNG states; tokenizer: tokenizer_to_checkpoint of the dataset's meta.json; provenance:
    provenance.provenance() of every process that trained the run so far, oldest first.
    """
    state = {
        "model": model if isinstance(model, dict) else model.state_dict(),
        "model_args": model_args,
        "config": config,
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
        "tokenizer": tokenizer,
        "provenance": list(provenance),
        "optimizer": optimizer if isinstance(optimizer, dict) else optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": rng,
        "data_position": {"seed": config["seed"], "iter_num": iter_num},
    }
    if best:
        _atomic_save(os.path.join(out_dir, "best.pt"), {k: state[k] for k in BEST_KEYS})
    _atomic_save(os.path.join(out_dir, "ckpt.pt"), {k: state[k] for k in CKPT_KEYS})


def _atomic_save(path, state):
    with atomic_open(path) as f:
        torch.save(state, f)


def load_checkpoint(out_dir, ckpt="best.pt", device="cpu"):
    """torch.load(out_dir/ckpt, weights_only=True) -> the checkpoint dict.

    model_args written under an old GPTConfig field name (model.RENAMED_FIELDS) come back under the
    new one; a field added later comes back with the value those runs had (LEGACY_MODEL_ARGS: YaRN's
    'paper' ramp, the only one before issue 60). Raises UserError when the file is missing or is not a
    checkpoint of this repo; for a sharded folder of checkpoint_format='dcp' (given, or there instead of the
    file), the command that converts it.
    """
    path = os.path.join(out_dir, ckpt)
    for folder in (path, out_dir, os.path.splitext(path)[0] + DCP_SUFFIX):  # a sharded folder (checkpoint_format='dcp')
        if not os.path.isfile(path) and os.path.isfile(os.path.join(folder, ".metadata")):
            raise UserError(convert_hint(folder))
    if not os.path.isfile(path):
        raise UserError(
            f"no checkpoint at {path}; train first (python train.py --out_dir={out_dir}) "
            "or point to a run folder that has one"
        )
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated file, pickle from elsewhere, ...
        raise UserError(f"cannot read {path} ({load_failure(e)}); is it a checkpoint of this repo?") from None
    if not isinstance(state, dict) or "model" not in state or "model_args" not in state:
        raise UserError(f"{path} is not a checkpoint of this repo (no 'model' / 'model_args')")
    state["model_args"] = current_model_args(state["model_args"])
    return state


def load_failure(e):
    """One line of what torch.load(weights_only=True) found wrong: its first sentence, without torch's advice to
    load with weights_only=False or to allow-list classes (which would run code from the file)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:  # not tensors and plain values: the reason only
        text = "not a file of tensors and plain values: " + text.split("WeightsUnpickler error:", 1)[1].strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first.split('. ')[0].rstrip('.')}"


def dcp_path(out_dir, name):
    """out_dir/ckpt.dcp for 'ckpt.pt' (and best.dcp for 'best.pt')."""
    return os.path.join(out_dir, os.path.splitext(name)[0] + DCP_SUFFIX)


def convert_hint(folder):
    """The one line that says how to turn a dcp folder into a file sample.py and the evaluation scripts read."""
    name = os.path.basename(os.path.normpath(folder))
    stem = name[: -len(DCP_SUFFIX)] if name.endswith(DCP_SUFFIX) else name
    target = os.path.join(os.path.dirname(os.path.normpath(folder)), stem + ".pt")
    return (
        f"{folder} is a sharded torch.distributed.checkpoint folder (checkpoint_format='dcp'); convert it to "
        f"one file first: python sharding.py {folder} {target}"
    )


def current_model_args(model_args):
    """A checkpoint's model_args (dict) under today's GPTConfig names: old field names renamed
    (model.RENAMED_FIELDS), fields added later filled with the value the older runs had (LEGACY_MODEL_ARGS)."""
    return {**LEGACY_MODEL_ARGS, **{RENAMED_FIELDS.get(k, k): v for k, v in model_args.items()}}


def build_model(state, device="cpu", **overrides):
    """GPT from a checkpoint dict, its weights loaded, in eval mode on `device`.

    overrides replace GPTConfig fields (e.g. attn_backend='torch'); the weights must still fit.
    """
    model = GPT(GPTConfig(**{**state["model_args"], **overrides}))
    model.load_state_dict(state["model"])
    return model.eval().to(device)


def load_run(out_dir, ckpt="best.pt", device="cpu", **overrides):
    """(model, checkpoint dict) of a run folder; see load_checkpoint and build_model."""
    state = load_checkpoint(out_dir, ckpt, device)
    return build_model(state, device, **overrides), state


def tokenizer_to_checkpoint(meta, data_dir=None):
    """The part of a dataset's meta.json that a checkpoint stores for decoding (TOKENIZER_KEYS), under
    the key "tokenizer"; tokenizer_from_checkpoint reads it back.

    A tokenizer that decodes from a file in the dataset folder (meta["tokenizer"]["file"], e.g.
    MAESTRO's miditok tokenizer.json) gets that file's text embedded as tokenizer["file_text"] when
    data_dir is given and holds the file, so the run folder decodes without the dataset folder.
    """
    entry = {k: meta.get(k) for k in TOKENIZER_KEYS}
    tok = entry["tokenizer"]
    if isinstance(tok, dict) and tok.get("file") and "file_text" not in tok and data_dir is not None:
        path = os.path.join(data_dir, tok["file"])
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                entry["tokenizer"] = {**tok, "file_text": f.read()}
    return entry


def tokenizer_from_checkpoint(state, data_root=None, source=None):
    """The tokenizer description of a checkpoint dict: {"dataset", "vocab_size", "pad_id", "tokenizer"}.

    Read from the checkpoint first; for checkpoints written before tokenizers were stored there,
    from <data_root or the run's data_root>/<dataset>/meta.json. source: the checkpoint's path, for
    the message. Raises UserError naming both places and the fix.
    """
    if state.get("tokenizer"):
        return state["tokenizer"]
    cfg = state.get("config", {})
    root = data_root or cfg.get("data_root", "data")
    data_dir = os.path.join(root, str(cfg.get("dataset")))
    path = os.path.join(data_dir, "meta.json")
    if os.path.isfile(path):
        with open(path) as f:
            return tokenizer_to_checkpoint(json.load(f), data_dir)
    raise UserError(
        f"no tokenizer: {source or 'the checkpoint'} stores none (written before train.py stored it) "
        f"and {path} does not exist; prepare the dataset '{cfg.get('dataset')}' there (or point "
        f"--data_root to it), or resume the run once with this train.py to store it"
    )


PROVENANCE_KEYS = ("source", "file", "file_text")  # where a tokenizer was read from, not what its ids mean


def same_tokenizer(a, b):
    """True if two tokenizer descriptions (tokenizer_from_checkpoint / tokenizer_to_checkpoint / a meta.json) give every
    token id the same meaning: equal vocab_size, pad_id and "tokenizer" entries (kind, symbols, ...),
    ignoring PROVENANCE_KEYS (e.g. GPT-2 read through tiktoken or a local copy); an embedded tokenizer
    file's text (file_text) is compared when both carry it."""
    ta, tb = a.get("tokenizer") or {}, b.get("tokenizer") or {}

    def meaning(d, t):
        return d.get("vocab_size"), d.get("pad_id"), {k: v for k, v in t.items() if k not in PROVENANCE_KEYS}

    if meaning(a, ta) != meaning(b, tb):
        return False
    return "file_text" not in ta or "file_text" not in tb or ta["file_text"] == tb["file_text"]


def describe_tokenizer(meta):
    """One line naming a tokenizer description: kind, dataset, vocab_size and the first symbols."""
    tok = meta.get("tokenizer") or {}
    text = f"the {tok.get('kind')!r} tokenizer of dataset {meta.get('dataset')!r} ({meta.get('vocab_size')} ids"
    if tok.get("itos"):
        symbols = "".join(map(str, tok["itos"]))
        text += f", symbols {symbols[:40]!r}" + ("..." if len(symbols) > 40 else "")
    return text + ")"


def load_finetune_checkpoint(init_ckpt, model_args, out_dir, device, data_tokenizer, state=None):
    """init_from='finetune': the checkpoint dict of init_ckpt (a path to a .pt file), checked against the run.
    state: the checkpoint dict, read already (init_from='hf': hf/load.py's, init_ckpt the folder's weights file).

    Updates model_args (this run's GPTConfig fields) in place: the checkpoint's architecture, this run's
    FINETUNE_FREE settings, and YaRN's rope_original_block_size (the checkpoint's, or its block_size) when
    the run sets rope_scaling without it. The encoding stays, but for DroPE (arXiv 2512.12167): a RoPE
    checkpoint without YaRN fine-tuned with pos_encoding='none' (DROPE; rope_theta is then moot).
    Raises UserError (exit 2) if init_ckpt is empty, if out_dir is
    init_ckpt's folder under any spelling (symlinks too), if this dataset's tokenizer (data_tokenizer, from
    tokenizer_to_checkpoint) is not the one the checkpoint was trained with, or if the run asks for
    another encoding (but DroPE's), or other shapes (learned position embeddings: another block_size too; n_kv_head
    None and n_head count as equal).
    """
    if not init_ckpt:
        raise UserError(
            "init_from='finetune' needs init_ckpt, the checkpoint to start from, "
            "e.g. --init_ckpt=out-owt-124m-rope/best.pt"
        )
    ckpt_dirs = {
        os.path.realpath(os.path.dirname(os.path.abspath(init_ckpt))),  # the folder named, resolved
        os.path.dirname(os.path.realpath(init_ckpt)),
    }  # the folder of the file a symlink points to
    if os.path.realpath(out_dir) in ckpt_dirs:
        raise UserError(
            f"out_dir={out_dir!r} holds init_ckpt {init_ckpt}: a fine-tune would overwrite it; choose a new out_dir"
        )
    if state is None:
        state = load_checkpoint(os.path.dirname(init_ckpt) or ".", os.path.basename(init_ckpt), device)
    trained = tokenizer_from_checkpoint(state, source=init_ckpt)
    if not same_tokenizer(trained, data_tokenizer):
        raise UserError(
            f"init_ckpt {init_ckpt} was trained with {describe_tokenizer(trained)}, this run's data uses "
            f"{describe_tokenizer(data_tokenizer)}: its token ids would change meaning; fine-tune on data "
            "prepared with the checkpoint's tokenizer"
        )
    old = {**asdict(GPTConfig()), **state["model_args"]}
    for args in (model_args, old):  # n_kv_head None means n_head: one architecture, however it is written
        args["n_kv_head"] = args["n_kv_head"] or args["n_head"]
    if model_args["pos_encoding"] != old["pos_encoding"]:
        if (old["pos_encoding"], model_args["pos_encoding"]) != DROPE:
            raise UserError(
                f"init_from='finetune' changes the encoding only from 'rope' to 'none' (DroPE); {init_ckpt} "
                f"has pos_encoding={old['pos_encoding']!r} and this run asks for "
                f"{model_args['pos_encoding']!r}: set pos_encoding={old['pos_encoding']!r}"
            )
        if old.get("rope_scaling", 1.0) != 1.0:
            raise UserError(
                f"{init_ckpt} is a YaRN fine-tune (rope_scaling={old['rope_scaling']}); DroPE starts from "
                "a RoPE checkpoint without YaRN: give the pretraining run's best.pt"
            )
    rope_only = ("rope_theta",) if model_args["pos_encoding"] != old["pos_encoding"] else ()  # moot without RoPE
    diff = [k for k in model_args if k not in FINETUNE_FREE + ("pos_encoding",) + rope_only and model_args[k] != old[k]]
    if old["pos_encoding"] == "learned" and model_args["block_size"] != old["block_size"]:
        diff.append("block_size")
    if diff:
        raise UserError(
            f"init_from='finetune' keeps the encoding and shapes of {init_ckpt}: it has "
            + ", ".join(f"{k}={old[k]!r}" for k in diff)
            + "; this run asks for "
            + ", ".join(f"{k}={model_args[k]!r}" for k in diff)
            + f" (set them as the checkpoint has them; only {', '.join(FINETUNE_FREE[:4])} may change"
            + (", and not block_size for learned position embeddings" if "block_size" in diff else "")
            + ")"
        )
    model_args["pope_delta_init"] = old["pope_delta_init"]
    if model_args["rope_scaling"] != 1.0 and not model_args["rope_original_block_size"]:
        model_args["rope_original_block_size"] = old["rope_original_block_size"] or old["block_size"]
    return state


def miditok_tokenizer(meta):
    """The miditok tokenizer of a tokenizer description of kind 'miditok' (MAESTRO), rebuilt from the
    tokenizer.json text the checkpoint embeds (see tokenizer_to_checkpoint). Raises UserError if it
    has none."""
    tok = meta.get("tokenizer") or {}
    if tok.get("kind") != "miditok" or not tok.get("file_text"):
        raise UserError(
            f"tokenizer {tok.get('kind')!r} embeds no miditok tokenizer.json; resume the run once "
            "with this train.py, with the dataset folder present, to store it"
        )
    import miditok

    with tempfile.TemporaryDirectory() as folder:  # miditok reads its parameters from a file
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write(tok["file_text"])
        return getattr(miditok, tok.get("class", "REMI"))(params=path)


def load_codec(meta):
    """(encode, decode) for a tokenizer description: str -> list[int] and list[int] -> str.

    'char' and 'gpt2' tokenizers decode to text (padding dropped); any other kind encodes a list of
    ids written as text ("[1, 2, 3]") and decodes to space-separated ids.
    """
    tok = meta.get("tokenizer") or {}
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
    return _ids, (lambda ids: " ".join(map(str, ids)))


def _ids(text):
    try:
        ids = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        ids = None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(
            "this dataset's tokenizer has no text codec here: give the prompt as token ids, e.g. --start='[1, 2, 3]'"
        )
    return ids
