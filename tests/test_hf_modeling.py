"""The exported model's forward where the repo's GPT is the second code path (hf/modeling_pope_gpt.py): half
precision, explicit position_ids with the cache, positions near 100k, left padding under both attention
implementations, transformers' -100 labels, YaRN under transformers' older `type` key. Real transformers, CPU.

One export per encoding for the whole module (tests/test_hf_export.py's built_model: peaked attention, PoPE's delta
on [-2 pi, 0], grouped heads, a character vocabulary): positions and padding change these models' numbers.
"""

import json
import math
import os
import shutil
import types

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_export import (
    CHAR_TEXT,
    CHAR_TOKENIZER,
    ENCODINGS,
    ITOS,
    L,
    built_model,
    cache_of,
    char_ids,
    relative_error,
    save_run,
)  # noqa: E402

from checkpoint import load_run  # noqa: E402
from hf import export as hf_export  # noqa: E402

ABSOLUTE = ("learned", "sinusoidal")


@pytest.fixture(scope="module")
def export_of(tmp_path_factory):
    """export_of(name) -> (the repo's GPT of the run, the exported folder) of ENCODINGS[name], exported once per
    module. Each folder has a name of its own (transformers caches a folder's code under its name)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("hf_modeling")
    done = {}

    def get(name):
        if name not in done:
            model = built_model(len(ITOS), seed=11, **ENCODINGS[name])
            run = save_run(root / f"run-{name}", model, CHAR_TOKENIZER)
            out = hf_export.export(run, str(root / f"hf-{root.name}-{name}"))
            done[name] = (load_run(run)[0], out)
        return done[name]

    yield get
    mp.undo()


def load_hf(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kw).eval()


def ids(text):
    return torch.tensor([char_ids(text)])


# --- half precision ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_every_encoding_runs_in_bf16_and_fp16_near_its_fp32_logits(name, export_of):
    """Loaded with dtype=bfloat16 / float16 (as lm-eval's dtype= and most serving code load), the forward runs and its
    logits stay within the half type's rounding of fp32's; the cached continuation too."""
    _, out = export_of(name)
    x = torch.tensor([char_ids(CHAR_TEXT[:L]), char_ids(CHAR_TEXT[7 : 7 + L])])
    with torch.no_grad():
        want = load_hf(out)(x).logits
        for dtype, tol in ((torch.bfloat16, 4e-2), (torch.float16, 8e-3)):
            for impl in ("sdpa", "eager"):
                hf = load_hf(out, dtype=dtype, attn_implementation=impl)
                got = hf(x).logits
                assert got.dtype == dtype and torch.isfinite(got).all(), (dtype, impl)
                assert relative_error(got, want) <= tol, (dtype, impl, relative_error(got, want))
                first = hf(x[:, :20], use_cache=True)
                rest = hf(x[:, 20:], cache=cache_of(first), use_cache=True).logits
                assert relative_error(rest, want[:, 20:]) <= tol, (dtype, impl, "cached")


# --- explicit positions with the cache --------------------------------------------------------------------------------


def given_positions(name, T):
    """(2, T) int64 increasing positions with a jump, another per row: past block_size for the relative encodings."""
    if name in ABSOLUTE:
        rows = [list(range(3, 3 + 9)) + list(range(20, 20 + T - 9)), list(range(T))]
    else:
        rows = [list(range(100, 100 + 9)) + list(range(150, 150 + T - 9)), list(range(37, 37 + T))]
    return torch.tensor(rows)


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_a_cached_continuation_at_given_positions_equals_the_full_forward(name, export_of):
    """position_ids (B, T), each key keeping the position it was given: the forward in three cached steps (9 + 1 + 2
    tokens) equals one full forward at the same positions, which equals the repo's GPT.forward(position_ids=) (for
    ALiBi where the positions have no jump: model.py's ALiBi takes index distances)."""
    gpt, out = export_of(name)
    hf = load_hf(out)
    T = 12
    x = torch.tensor([char_ids(CHAR_TEXT[:T]), char_ids(CHAR_TEXT[5 : 5 + T])])
    p = given_positions(name, T)
    with torch.no_grad():
        full = hf(x, position_ids=p).logits
        rows = [1] if name == "alibi_half" else [0, 1]  # model.py's ALiBi: index distances (row 1: no jump)
        assert relative_error(full[rows], gpt(x, position_ids=p)[0][rows]) <= 1e-5
        steps, cache = [], None
        for a, b in ((0, 9), (9, 10), (10, T)):
            r = hf(x[:, a:b], position_ids=p[:, a:b], cache=cache, use_cache=True)
            steps.append(r.logits)
            cache = cache_of(r)
    assert relative_error(torch.cat(steps, dim=1), full) <= 1e-5


# --- large positions --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pope", "rope", "yarn_code"])
def test_logits_with_keys_100k_positions_back_equal_gpt_forward(name, export_of):
    """Half the tokens at positions 0, 3, 6, ..., the other half near 100,000: phases t theta of ~1e5 radians, and
    query-key distances of ~1e5. Phases formed in float32 are off by ~4e-3 radians; PoPE's frequencies not rounded
    to float32 (as pope.py rounds them) are off by up to 7e-4 radians at a distance of 1e5 (an error that cancels
    between a query and a key near each other, so only far keys show it). Either drift is seen by the 1e-5 check."""
    gpt, out = export_of(name)
    hf = load_hf(out)
    x = torch.tensor([char_ids(CHAR_TEXT[:L])])
    p = torch.arange(L)[None] * 3
    p[:, L // 2 :] += 100_000
    with torch.no_grad():
        got, want = hf(x, position_ids=p).logits, gpt(x, position_ids=p)[0]
    assert relative_error(got, want) <= 1e-5


# --- left padding, both attention implementations ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["pope", "alibi_half", "learned"])
def test_left_padded_rows_equal_each_row_alone_under_both_implementations(name, impl, export_of):
    """A left-padded batch (padding queries see no key): every logit finite, each row's real tokens give the row's
    GPT.forward alone."""
    gpt, out = export_of(name)
    hf = load_hf(out, attn_implementation=impl)
    texts = [CHAR_TEXT[:14], CHAR_TEXT[3:8], CHAR_TEXT[10:19]]
    width = max(map(len, texts))
    x = torch.tensor([[0] * (width - len(t)) + char_ids(t) for t in texts])
    mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in texts])
    with torch.no_grad():
        logits = hf(input_ids=x, attention_mask=mask).logits
        assert torch.isfinite(logits).all()
        for i, t in enumerate(texts):
            alone = gpt(ids(t))[0][0]
            assert relative_error(logits[i, width - len(t) :], alone) <= 1e-5, i


# --- the loss ---------------------------------------------------------------------------------------------------------


def test_the_loss_ignores_the_minus_100_labels_of_transformers_collators(export_of):
    """labels as DataCollatorForLanguageModeling gives them (right padding): -100 at padding and at targets masked
    out. The loss is the mean cross-entropy in nats over the other targets, computed in float64 from GPT.forward of
    each row alone; its gradient is finite."""
    gpt, out = export_of("pope")
    hf = load_hf(out)
    texts = [CHAR_TEXT[:16], CHAR_TEXT[4:13]]
    width = max(map(len, texts))
    x = torch.tensor([char_ids(t) + [0] * (width - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    labels = x.masked_fill(mask == 0, -100)
    labels[0, 5] = labels[1, 7] = -100  # targets a collator masked out
    loss = hf(input_ids=x, attention_mask=mask, labels=labels).loss
    total, n = 0.0, 0
    with torch.no_grad():
        for i, t in enumerate(texts):
            logp = torch.log_softmax(gpt(ids(t))[0][0].double(), dim=-1)
            for j in range(len(t) - 1):
                if labels[i, j + 1] != -100:
                    total, n = total - float(logp[j, labels[i, j + 1]]), n + 1
    assert n == 15 + 8 - 2 and float(loss.detach()) == pytest.approx(total / n, rel=1e-5)
    loss.backward()
    assert all(torch.isfinite(q.grad).all() for q in hf.parameters() if q.grad is not None)


# --- YaRN under transformers' older key -------------------------------------------------------------------------------


def test_yarn_named_under_the_older_type_key_reads_as_yarn(export_of, tmp_path):
    """config.json's rope_scaling {"type": "yarn", ...} (transformers 4's older name of rope_type, as older configs
    and hand-written ones have it): the model is YaRN (GPT's logits past the original context), and hf/load.py reads
    it as rope_scaling 4.0."""
    from hf.load import checkpoint_from_folder
    from hf.modeling_pope_gpt import yarn_params

    gpt, out = export_of("yarn_code")
    old = tmp_path / f"hf-old-type-{tmp_path.name}"
    shutil.copytree(out, old)
    with open(old / "config.json") as f:
        cfg = json.load(f)
    cfg["rope_scaling"]["type"] = cfg["rope_scaling"].pop("rope_type")
    with open(old / "config.json", "w") as f:
        json.dump(cfg, f)
    x = ids(CHAR_TEXT[:L])
    with torch.no_grad():
        assert relative_error(load_hf(str(old))(x).logits, gpt(x)[0]) <= 1e-5
    # transformers 5 adds rope_type itself when it reads the config; transformers 4 keeps the dict as written
    kept_as_written = types.SimpleNamespace(rope_scaling=cfg["rope_scaling"])
    assert yarn_params(kept_as_written) == (4.0, 8, 32.0, 1.0, cfg["rope_scaling"]["attention_factor"])
    args = checkpoint_from_folder(str(old))["model_args"]
    assert (args["rope_scaling"], args["rope_original_block_size"]) == (4.0, 8)
    assert math.isclose(cfg["rope_scaling"]["attention_factor"], 0.1 * math.log(4.0) + 1.0)
    assert os.path.isfile(old / "model.safetensors")
