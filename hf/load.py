"""An exported Hugging Face folder (hf/export.py) read back as a checkpoint dict of this repo, for train.py's
init_from='hf': fine-tune a model that left this repo (and maybe came back from the hub or a PEFT merge).

    python train.py --init_from=hf --init_ckpt=hf-shakespeare-char-pope --max_iters=200 --out_dir=out-ft

The inverse of export.hf_config: config.json's fields -> GPTConfig's, model.safetensors -> the GPT's state dict (the
tied lm_head filled from transformer.wte where saved once), config.json's pope_tokenizer -> the tokenizer description
that checkpoint.load_finetune_checkpoint compares with the data's.
"""

import json
import math
import os

from cli import UserError
from hf.export import FIELDS


def checkpoint_from_folder(folder):
    """{"model", "model_args", "config", "iter_num", "best_val_loss", "tokenizer", "provenance"} of an exported
    folder. Raises UserError for a folder that is not one (no config.json of model_type 'pope_gpt', sharded or
    missing weights, no pope_tokenizer), attention_bias != mlp_bias, or a YaRN whose betas or attention_factor
    model.py does not have."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"init_from='hf': cannot read {path} ({e}); give a folder written by hf/export.py") from None
    if c.get("model_type") != "pope_gpt":
        raise UserError(
            f"init_from='hf': {folder} holds a {c.get('model_type')!r} model, not a 'pope_gpt' one exported by "
            "hf/export.py"
        )
    if c.get("attention_bias") != c.get("mlp_bias"):
        raise UserError(f"init_from='hf': {path} has attention_bias != mlp_bias; model.py has one bias setting")
    args = {ours: c[hf] for ours, hf in FIELDS.items() if hf in c}
    args.update(bias=c.get("attention_bias", False), rope_scaling=1.0, rope_original_block_size=0)
    yarn = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if yarn.get("rope_type", yarn.get("type")) == "yarn":
        if (yarn.get("beta_fast", 32.0), yarn.get("beta_slow", 1.0)) != (32.0, 1.0):
            raise UserError(f"init_from='hf': {path}'s YaRN has beta_fast/beta_slow other than model.py's 32/1")
        s = float(yarn["factor"])
        m = yarn.get("attention_factor")
        if m is not None and not math.isclose(m, 0.1 * math.log(s) + 1.0, rel_tol=1e-6):
            raise UserError(
                f"init_from='hf': {path}'s YaRN has attention_factor {m}, model.py's is 0.1 ln(factor) + 1 = "
                f"{0.1 * math.log(s) + 1.0:.6g}"
            )
        args["rope_scaling"] = s
        args["rope_original_block_size"] = int(yarn["original_max_position_embeddings"])
    weights = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(weights):
        sharded = os.path.isfile(weights + ".index.json")
        raise UserError(
            f"init_from='hf': no {weights}"
            + (" (sharded: save it with save_pretrained(..., max_shard_size='100GB'))" if sharded else "")
        )
    if not c.get("pope_tokenizer"):
        raise UserError(
            f"init_from='hf': {path} has no pope_tokenizer (the run's tokenizer); export the run again with "
            "hf/export.py"
        )
    from safetensors.torch import load_file

    model = load_file(weights)
    for a, b in (("lm_head.weight", "transformer.wte.weight"), ("transformer.wte.weight", "lm_head.weight")):
        if a not in model and b in model:  # tied: saved once
            model[a] = model[b]
    return {
        "model": model,
        "model_args": args,
        "config": {},
        "iter_num": None,
        "best_val_loss": None,
        "tokenizer": c["pope_tokenizer"],
        "provenance": [],
    }
