"""hf/export.py and the exported folder against this repo's GPT: logits, generate, padding, the cache, the tokenizer,
save_pretrained, the refusals and the atomic write. Real transformers, fp32, CPU, no network.

References: GPT.forward / GPT.generate of the same checkpoint (checkpoint.load_run), one unpadded sequence at a time;
the tokenizer against checkpoint.load_codec (tiktoken, the character table). Models have their attention projection
scaled up (peaked attention: positions and padding change the numbers) and PoPE's delta drawn on [-2 pi, 0], or are
trained (conftest's char_pretrained run). lm-eval's `hf` backend: tests/test_hf_lm_eval.py.
"""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("transformers")

from conftest import CHAR_TEXT  # noqa: E402

from checkpoint import load_codec, load_run, save_checkpoint  # noqa: E402
from hf import export as hf_export  # noqa: E402
from model import GPT, GPTConfig, KVCache  # noqa: E402
from provenance import provenance  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITOS = sorted(set(CHAR_TEXT))
CHAR_TOKENIZER = {
    "dataset": "chars",
    "vocab_size": len(ITOS),
    "pad_id": None,
    "tokenizer": {"kind": "char", "itos": ITOS},
}
GPT2_TOKENIZER = {"dataset": "owt", "vocab_size": 50257, "pad_id": None, "tokenizer": {"kind": "gpt2"}}
L = 32  # block_size of the built models
ENCODINGS = {  # id -> GPTConfig fields
    "pope": dict(pos_encoding="pope"),
    "pope_relu": dict(pos_encoding="pope", pope_magnitude="relu"),
    "pope_identity_nodelta": dict(pos_encoding="pope", pope_magnitude="identity", pope_use_delta=False),
    "rope": dict(pos_encoding="rope"),
    "yarn_code": dict(pos_encoding="rope", rope_scaling=4.0, rope_original_block_size=8, rope_yarn_ramp="code"),
    "yarn_paper": dict(pos_encoding="rope", rope_scaling=4.0, rope_original_block_size=8, rope_yarn_ramp="paper"),
    "none": dict(pos_encoding="none"),
    "rope_half": dict(pos_encoding="rope_half"),
    "alibi_half": dict(pos_encoding="alibi_half"),
    "learned": dict(pos_encoding="learned"),
    "sinusoidal": dict(pos_encoding="sinusoidal"),
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("GPT2_BPE_SOURCE", "local")  # no network: skip tiktoken's download attempt


def built_model(vocab_size, seed=0, n_head=4, n_kv_head=2, **fields):
    """A GPT with peaked attention (c_attn x 6), residual branches that outweigh the token's own embedding (c_proj
    x 30: greedy decoding does not repeat the input token), delta uniform on [-2 pi, 0], random RMSNorm gains; GQA."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        block_size=L, vocab_size=vocab_size, n_layer=2, n_head=n_head, n_kv_head=n_kv_head, n_embd=64, **fields
    )
    cfg.pope_delta_init = "uniform"
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(6.0)
            block.ln_1.weight.uniform_(0.5, 1.5)
            block.attn.c_proj.weight.mul_(30.0)
            block.mlp.c_proj.weight.mul_(30.0)
    return model.eval()


def save_run(folder, model, tokenizer, metrics=None):
    """A run folder as train.py leaves it (checkpoint.save_checkpoint: best.pt and ckpt.pt), with metrics.json."""
    os.makedirs(folder, exist_ok=True)
    save_checkpoint(
        str(folder),
        model=model,
        optimizer={},
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        model_args=asdict(model.config),
        config={"seed": 0, "dataset": tokenizer["dataset"], "block_size": model.config.block_size},
        iter_num=7,
        best_val_loss=1.25,
        rng={},
        tokenizer=tokenizer,
        best=True,
        provenance=[provenance()],
    )
    if metrics is not None:
        with open(os.path.join(folder, "metrics.json"), "w") as f:
            json.dump(metrics, f)
    return str(folder)


def load_hf(folder, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kw).eval()


def exported(tmp_path, model, tokenizer, **kw):
    """(run folder, exported folder). The folder's name is the test's: transformers caches a folder's code under its
    name (HF_MODULES_CACHE), so tests on two xdist workers never write the same cached module at once."""
    run = save_run(tmp_path / "run", model, tokenizer, **kw)
    return run, hf_export.export(run, str(tmp_path / f"hf-{tmp_path.name}"))


def cache_of(output):
    """The Cache a forward returned: the output's field `cache` (newer transformers, 5.24 here, where
    `past_key_values` is a deprecated alias) or `past_key_values` (older, e.g. 5.17 on the H200's image)."""
    return output.cache if "cache" in type(output).__dataclass_fields__ else output.past_key_values


def relative_error(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def char_ids(text):
    return [ITOS.index(c) for c in text]


# --- logits -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_logits_equal_gpt_forward_for_every_encoding_with_gqa(name, tmp_path):
    model = built_model(len(ITOS), **ENCODINGS[name])
    run, out = exported(tmp_path, model, CHAR_TOKENIZER)
    gpt, _ = load_run(run)
    absolute = ENCODINGS[name]["pos_encoding"] in ("learned", "sinusoidal")
    text = CHAR_TEXT[: L if absolute else 2 * L]  # relative encodings past block_size too
    x = torch.tensor([char_ids(text), char_ids(CHAR_TEXT[5 : 5 + len(text)])])
    with torch.no_grad():
        want = gpt(x)[0]
        for impl in ("sdpa", "eager"):
            hf = load_hf(out, attn_implementation=impl)
            assert hf.config._attn_implementation == impl
            got = hf(x).logits
            assert relative_error(got, want) <= 1e-5, (name, impl, relative_error(got, want))


def gpt2_model(pos_encoding="pope", seed=0):
    return built_model(50304, seed=seed, pos_encoding=pos_encoding)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_gpt2_bpe_run_logits_and_tokenizer(pos_encoding, tmp_path):
    from transformers import AutoTokenizer

    run, out = exported(tmp_path, gpt2_model(pos_encoding), GPT2_TOKENIZER)
    gpt, state = load_run(run)
    encode, decode = load_codec(state["tokenizer"])
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    text = "It was the best of times, it was the worst of times; naïve café 🤖\n\n  it's   4096<|endoftext|>The"
    ids = encode(text)
    assert tok(text)["input_ids"] == ids and tok.decode(ids) == decode(ids) == text
    assert tok.eos_token_id == tok.bos_token_id == 50256 and tok.model_max_length == L
    x = torch.tensor([ids[:L]])
    hf = load_hf(out)
    with torch.no_grad():
        err = relative_error(hf(x).logits, gpt(x)[0])
    assert err <= 1e-5
    loss = hf(x, labels=x).loss  # transformers' convention: labels are the inputs, shifted inside (fine-tuning, PEFT)
    with torch.no_grad():
        want = float(gpt(x[:, :-1], targets=x[:, 1:])[1])
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()
    grads = [p.grad for p in hf.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads) and len(grads) == len(list(gpt.parameters()))


def test_char_tokenizer_round_trips_every_symbol_and_pad(tmp_path):
    from transformers import AutoTokenizer

    itos = list("ab\n ,.") + ["<pad>"]  # indirect indexing's layout: characters, then a '<pad>' symbol
    meta = {
        "dataset": "ii",
        "vocab_size": len(itos),
        "pad_id": len(itos) - 1,
        "tokenizer": {"kind": "char", "itos": itos},
    }
    _, out = exported(tmp_path, built_model(len(itos)), meta)
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    encode, decode = load_codec(meta)
    text = "ab  a,\n\nb. .a"
    assert tok(text)["input_ids"] == encode(text)
    assert tok.decode(encode(text)) == text and tok.pad_token == "<pad>" and tok.pad_token_id == 6
    assert tok("a<pad>b")["input_ids"] == [0, 6, 1]
    assert tok.decode([0, 6, 1], skip_special_tokens=True) == decode([0, 6, 1]) == "ab"
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["pad_token_id"] == 6


# --- generate, padding, the cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize("pos_encoding", ["pope", "rope", "alibi_half"])
def test_greedy_generate_with_the_cache_equals_gpt_generate(pos_encoding, tmp_path):
    run, out = exported(tmp_path, gpt2_model(pos_encoding, seed=1), GPT2_TOKENIZER)
    gpt, _ = load_run(run)
    hf = load_hf(out)
    prompt = torch.tensor([[464, 3797, 3332, 319, 262]])  # "The cat sat on the"
    n = 3 * L  # past block_size: the relative encodings extrapolate
    want = gpt.generate(prompt, n, temperature=0)
    got = hf.generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert got.tolist() == want.tolist()
    assert len(set(want[0, 5:].tolist())) > 3  # not one repeated token


def test_trained_char_run_generates_as_gpt(char_pretrained, tmp_path):
    from transformers import AutoTokenizer

    out = hf_export.export(char_pretrained["run"], str(tmp_path / f"hf-{tmp_path.name}"))
    gpt, _ = load_run(char_pretrained["run"])
    hf, tok = load_hf(out), AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    prompt = tok("to be, or", return_tensors="pt")["input_ids"]
    want = gpt.generate(prompt, 40, temperature=0)
    got = hf.generate(prompt, max_new_tokens=40, do_sample=False)
    assert got.tolist() == want.tolist()
    assert "to be" in tok.decode(got[0, prompt.shape[1] :])  # the run learnt some of its text


def test_model_card_records_settings_losses_provenance_and_citation(tmp_path):
    metrics = {
        s: {"loss": loss, "ppl": 2.0, "acc": 0.5, "targets": 1000} for s, loss in (("val", 1.2345), ("test", 1.3456))
    }
    _, out = exported(tmp_path, built_model(len(ITOS), **ENCODINGS["pope"]), CHAR_TOKENIZER, metrics=metrics)
    with open(os.path.join(out, "README.md")) as f:
        card = f.read()
    assert "- val: 1.2345 (perplexity" in card and "- test: 1.3456 (perplexity" in card
    assert "| model.pos_encoding | pope |" in card and "| model.n_kv_head | 2 |" in card and "iteration 7" in card
    assert f"commit {provenance()['code']['commit'][:12]}" in card
    assert "Decoupling the What and Where with Polar Coordinate Positional Embedding" in card and "2509.10534" in card


@pytest.mark.parametrize("pos_encoding", ["pope", "rope", "alibi_half", "learned"])
def test_left_padded_batch_gives_each_rows_unpadded_result(pos_encoding, tmp_path):
    run, out = exported(tmp_path, gpt2_model(pos_encoding, seed=2), GPT2_TOKENIZER)
    gpt, _ = load_run(run)
    hf = load_hf(out)
    prompts = [[464, 3797, 3332, 319, 262, 2603, 11], [15496, 995], [40, 716, 257, 1310]]
    width = max(map(len, prompts))
    ids = torch.tensor([[50256] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    n = 12
    got = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits
    for i, p in enumerate(prompts):
        want = gpt.generate(torch.tensor([p]), n, temperature=0)[0, len(p) :]
        assert got[i, width:].tolist() == want.tolist(), i
        with torch.no_grad():
            alone = gpt(torch.tensor([p]))[0][0]
        assert relative_error(logits[i, width - len(p) :], alone) <= 1e-5


def test_pope_cache_holds_key_magnitudes_as_the_repos_kv_cache(tmp_path):
    """PoPE's DynamicCache keeps RoPE's bytes: keys' magnitudes softplus(k), d wide, as model.KVCache does; an
    incremental forward over it gives the full forward's logits."""
    run, out = exported(tmp_path, gpt2_model("pope", seed=3), GPT2_TOKENIZER)
    gpt, _ = load_run(run)
    hf = load_hf(out)
    x = torch.tensor([[464, 3797, 3332, 319, 262, 2603, 11, 290, 262, 3290]])
    T, d = x.shape[1], 64 // 4
    kv = KVCache(gpt.config.n_layer, T)
    with torch.no_grad():
        gpt.hidden_states(x, kv)
        first = hf(x[:, :6], use_cache=True)
        rest = hf(x[:, 6:], cache=cache_of(first), use_cache=True)
        full = hf(x).logits
    cache = cache_of(rest)
    assert cache.get_seq_length() == T
    for layer in range(gpt.config.n_layer):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert keys.shape == values.shape == (1, 2, T, d)  # n_kv_head key magnitudes and values, d wide each
        assert torch.allclose(keys, kv.k[layer], rtol=1e-5, atol=1e-6) and (keys >= 0).all()
        assert torch.allclose(values, kv.v[layer], rtol=1e-5, atol=1e-6)
    assert relative_error(torch.cat((first.logits, rest.logits), dim=1), full) <= 1e-5


# --- save_pretrained, self-containment -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["pope", "yarn_paper"])
def test_save_pretrained_then_from_pretrained_round_trips_bit_for_bit(name, tmp_path):
    _, out = exported(tmp_path, built_model(len(ITOS), seed=4, **ENCODINGS[name]), CHAR_TOKENIZER)
    hf = load_hf(out)
    hf.save_pretrained(tmp_path / f"again-{tmp_path.name}")
    again = load_hf(str(tmp_path / f"again-{tmp_path.name}"))
    a, b = hf.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again.lm_head.weight.data_ptr() == again.transformer.wte.weight.data_ptr()  # still tied
    for key in ("pos_encoding", "pope_magnitude", "pope_use_delta", "rope_theta", "rope_yarn_ramp"):
        assert getattr(again.config, key) == getattr(hf.config, key)
    x = torch.tensor([char_ids(CHAR_TEXT[:40])])
    with torch.no_grad():
        assert torch.equal(hf(x).logits, again(x).logits)


def test_config_json_uses_the_fields_names(tmp_path):
    _, out = exported(tmp_path, built_model(len(ITOS), **ENCODINGS["yarn_code"]), CHAR_TOKENIZER)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["auto_map"] == hf_export.AUTO_MAP and cfg["architectures"] == ["PopeGPTForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (
        64,
        4,
        2,
        2,
    )
    assert cfg["max_position_embeddings"] == L and cfg["rope_theta"] == 10000.0 and cfg["tie_word_embeddings"]
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4.0
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 8
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"  # a name transformers 4 and 5 know
    assert set(os.listdir(out)) >= {
        "config.json",
        "model.safetensors",
        "configuration_pope_gpt.py",
        "modeling_pope_gpt.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    }


def test_the_folder_loads_without_this_repo(tmp_path):
    """A fresh interpreter (-I: no PYTHONPATH, no user site), cwd elsewhere, the repo's modules unimportable: the
    folder's own code gives GPT's logits."""
    run, out = exported(tmp_path, built_model(len(ITOS), seed=5, pos_encoding="pope"), CHAR_TOKENIZER)
    gpt, _ = load_run(run)
    ids = char_ids(CHAR_TEXT[:40])
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({out!r}, trust_remote_code=True).eval()\n"
        f"logits = m(torch.tensor([{ids!r}])).logits[0].tolist()\n"
        "leaked = [n for n in ('model', 'pope', 'checkpoint', 'cli', 'pope_kernel') if n in sys.modules]\n"
        "r = {'logits': logits, 'leaked': leaked, 'path': sys.path}\n"
        f"json.dump(r, open({str(tmp_path / 'r.json')!r}, 'w'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-I", "-c", code], cwd=elsewhere, env=env, check=True, timeout=300)
    with open(tmp_path / "r.json") as f:
        r = json.load(f)
    assert r["leaked"] == [] and not any(os.path.realpath(p or ".") == REPO for p in r["path"])
    with torch.no_grad():
        want = gpt(torch.tensor([ids]))[0][0]
    assert relative_error(torch.tensor(r["logits"]), want) <= 1e-5


# --- refusals, atomicity ---------------------------------------------------------------------------------------------


def refused(argv, capsys):
    """The one line and exit code of `python hf/export.py ARGV` (its main, in this process)."""
    with pytest.raises(SystemExit) as e:
        hf_export.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_refusals(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no checkpoint at" in refused([str(empty), str(tmp_path / "o1")], capsys)
    dcp = tmp_path / "sharded"
    (dcp / "best.dcp").mkdir(parents=True)
    (dcp / "best.dcp" / ".metadata").write_bytes(b"")
    assert "python sharding.py" in refused([str(dcp), str(tmp_path / "o2")], capsys)
    run = save_run(tmp_path / "run", built_model(len(ITOS)), CHAR_TOKENIZER)
    for field, value, words in (
        ("pos_encoding", "xpos", "pos_encoding='xpos' is not supported"),
        ("n_expert", 8, "n_expert"),
    ):
        odd = tmp_path / f"odd-{field}"
        odd.mkdir()
        state = torch.load(os.path.join(run, "best.pt"), weights_only=True)
        state["model_args"][field] = value
        torch.save(state, odd / "best.pt")
        assert words in refused([str(odd), str(tmp_path / "o3")], capsys)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert "--force" in refused([run, str(full)], capsys)
    assert os.listdir(full) == ["keep.txt"]
    assert "is the run folder" in refused([run, run], capsys)
    assert "is the run folder" in refused([run, str(tmp_path)], capsys)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left
    assert "--force replaces only" in refused([run, str(full), "--force"], capsys)  # not an earlier export
    assert os.listdir(full) == ["keep.txt"]
    earlier = hf_export.export(run, str(tmp_path / "earlier"))
    hf_export.main([run, earlier, "--force", "--ckpt=ckpt"])  # --force replaces an earlier export
    assert "from `ckpt.pt`" in (tmp_path / "earlier" / "README.md").read_text()


def test_the_command_line_exits_2_with_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "hf", "export.py"), str(tmp_path / "nothing"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: no checkpoint at") and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("existing", [False, True])
def test_a_crash_mid_write_leaves_no_half_folder(existing, tmp_path, monkeypatch):
    run = save_run(tmp_path / "run", built_model(len(ITOS)), CHAR_TOKENIZER)
    out = tmp_path / "exports" / "hf"
    if existing:
        hf_export.export(run, str(out))
        before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(*a, **k):  # after config.json, the weights and the tokenizer were written
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf_export, "model_card", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        hf_export.export(run, str(out), force=True)
    if existing:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == (["hf"] if existing else [])  # no temporary folder left
