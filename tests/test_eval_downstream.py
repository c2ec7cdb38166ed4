"""study/eval_downstream.py: the lm-evaluation-harness adapter against direct computations with the model.

References are computed independently of the adapter: one sequence at a time (no batching, no
padding), log-softmax in float64, with a full forward pass (no KV cache). Attention weights are scaled up so
that positions and truncation change the numbers.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

import eval_downstream as ed  # noqa: E402
from checkpoint import load_codec  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

L = 16  # block_size of the tiny models
EOT = 50256


@pytest.fixture(scope="module")
def codec():
    os.environ.setdefault("GPT2_BPE_SOURCE", "local")  # no network: skip tiktoken's download attempt
    return load_codec({"tokenizer": {"kind": "gpt2"}})


def tiny_model(pos_encoding, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=L, n_layer=2, n_head=2, n_embd=32, pos_encoding=pos_encoding))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(6.0)  # peaked attention: position matters
    return model.eval()


def reference_logprobs(model, ids):
    """(T, vocab) log-probabilities (float64 log-softmax of the model's logits) of the next token after
    each of ids (len <= L): one unpadded sequence, a full forward pass."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    return F.log_softmax(logits[0].double(), dim=-1)


def instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("pos_encoding", ["rope", "pope"])
def test_loglikelihood_equals_a_direct_computation(pos_encoding, codec):
    encode, decode = codec
    model = tiny_model(pos_encoding)
    lm = ed.gpt_lm_class()(model, encode, decode, batch_size=3)
    long_ctx = "It was the best of times, it was the worst of times, it was the age of wisdom, and"
    pairs = [
        ("The cat sat on the", " mat"),
        ("One, two,", " three four five"),
        ("", "Hello world"),
        (long_ctx, " the age of foolishness"),  # longer than block_size: left-truncated
        ("Hello", " there"),
    ]
    assert len(encode(long_ctx)) > L
    got = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        if ctx:
            whole = encode(ctx + cont)
            n_cont = len(whole) - len(encode(ctx))
        else:
            whole, n_cont = [EOT] + encode(cont), len(encode(cont))
        seq = whole[-(L + 1) :]  # at most L inputs, predicting the last n_cont tokens
        lp = reference_logprobs(model, seq[:-1])[-n_cont:]
        target = torch.tensor(seq[-n_cont:])
        assert ll == pytest.approx(float(lp.gather(1, target[:, None]).sum()), rel=1e-6, abs=1e-5)
        assert greedy == bool((lp.argmax(-1) == target).all())


def test_loglikelihood_rolling_sums_disjoint_windows(codec):
    encode, decode = codec
    model = tiny_model("rope", seed=1)
    lm = ed.gpt_lm_class()(model, encode, decode)
    text = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do shake"
    text += (
        " the darling buds of May, and summer's lease hath all too short a date; sometime too hot the eye"
        " of heaven shines"
    )
    ids = encode(text)
    assert len(ids) > 2 * L
    padded = [EOT] + ids
    want = 0.0
    for start in range(0, len(ids), L):  # disjoint targets ids[start:end]; the last window keeps L inputs
        end = min(start + L, len(ids))
        lp = reference_logprobs(model, padded[max(0, end - L) : end])[-(end - start) :]
        want += float(lp.gather(1, torch.tensor(ids[start:end])[:, None]).sum())
    got = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    assert got[0] == pytest.approx(want, rel=1e-6, abs=1e-5)


def greedy_reference(model, ids, n):
    """n greedy tokens after ids, each from a full forward pass (no cache)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([out]))
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


@pytest.mark.parametrize("pos_encoding", ["rope", "pope"])
def test_generate_until_stops_at_the_stop_string_and_stays_within_block_size(pos_encoding, codec):
    encode, decode = codec
    model = tiny_model(pos_encoding, seed=2)
    lm = ed.gpt_lm_class()(model, encode, decode)
    context = "It was the best of times, it was the worst of times, it was the age of wisdom"
    max_gen = 6
    ids = encode(context)[-(L - max_gen) :]  # context left-truncated: context + generation <= block_size
    gen = greedy_reference(model, ids, max_gen)
    full = decode(gen)
    b = len(decode(gen[:2]))
    stop = full[b - 2 : b + 2]  # spans the boundary of generated tokens 2 and 3
    n_needed = next(m for m in range(1, max_gen + 1) if stop in decode(gen[:m]))
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    kwargs = {"until": [stop], "max_gen_toks": max_gen, "do_sample": False}
    nostop = {"until": ["\x00never"], "max_gen_toks": max_gen, "do_sample": False}
    got = lm.generate_until(instances("generate_until", [(context, kwargs)]), disable_tqdm=True)
    hook.remove()
    got += lm.generate_until(instances("generate_until", [(context, nostop)]), disable_tqdm=True)
    assert got[0] == full[: full.index(stop)]
    assert len(calls) == n_needed < max_gen  # stopped as soon as the stop string appeared
    assert got[1] == decode(gen)


def write_local_tasks(folder, mc_docs, gen_docs):
    """Two harness task YAMLs (multiple choice, generation) reading local JSON lines files."""
    for name, docs in (("mc", mc_docs), ("gen", gen_docs)):
        with open(folder / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (folder / "toy_mc.yaml").write_text(
        "task: toy_mc\n" + common.format(folder / "mc.jsonl") + "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "toy_gen.yaml").write_text(
        "task: toy_gen\n" + common.format(folder / "gen.jsonl") + "output_type: generate_until\n"
        "doc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


def test_harness_runs_a_local_multiple_choice_and_a_generation_task(codec, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    encode, decode = codec
    model = tiny_model("pope", seed=3)
    lm = ed.gpt_lm_class()(model, encode, decode)

    def ll(ctx, cont):
        whole = encode(ctx + cont)
        n = len(whole) - len(encode(ctx))
        lp = reference_logprobs(model, whole[:-1])[-n:]
        return float(lp.gather(1, torch.tensor(whole[-n:])[:, None]).sum())

    mc = [
        {"context": "The cat sat on the", "choices": [" mat", " moon"]},
        {"context": "One, two,", "choices": [" three", " banana"]},
    ]
    best = [max(range(2), key=lambda j: ll(d["context"], d["choices"][j])) for d in mc]
    mc[0]["label"], mc[1]["label"] = best[0], 1 - best[1]  # the model gets exactly one right
    prompt = "Hello there, my"
    gen_text = decode(greedy_reference(model, encode(prompt), 5)).split("\n")[0]
    gens = [{"prompt": prompt, "target": gen_text}, {"prompt": prompt, "target": gen_text + " not this"}]
    write_local_tasks(tmp_path, mc, gens)
    tm = ed.task_manager(str(tmp_path), include_defaults=False)
    res = ed.evaluate_run(lm, ["toy_mc", "toy_gen"], tm)
    assert res["results"]["toy_mc"]["acc,none"] == pytest.approx(0.5)
    assert res["results"]["toy_gen"]["exact_match,none"] == pytest.approx(0.5)
    table = ed.markdown_table([("tiny", res)], ["toy_mc", "toy_gen"])
    assert table.splitlines()[2] == "| tiny | 50.00 | 50.00 | 50.00 |"


def save_run(folder, tokenizer):
    from dataclasses import asdict

    model = tiny_model("rope")
    os.makedirs(folder, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "model_args": asdict(model.config),
            "config": {},
            "tokenizer": {"dataset": "x", "vocab_size": 50257, "pad_id": None, "tokenizer": tokenizer},
        },
        os.path.join(folder, "best.pt"),
    )
    return str(folder)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    fast_tm = ed.task_manager
    monkeypatch.setattr(
        ed, "task_manager", lambda p="": fast_tm(p, include_defaults=False)
    )  # index study/eval_tasks/ only
    good = save_run(tmp_path / "gpt2run", {"kind": "gpt2"})
    char = save_run(tmp_path / "charrun", {"kind": "char", "itos": list("ab")})
    cases = [
        ([str(tmp_path / "empty")], "no checkpoint at"),
        ([char], "'char' tokenizer"),
        ([good, "--tasks=cbt,no_such_task"], "unknown task(s) ['no_such_task']"),
        ([good, "--include_path=" + str(tmp_path / "nowhere")], "no such folder"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            ed.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1, err


# --- token-level behaviour, through a one-character-per-token codec (so every token is chosen here) --

ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ."  # 64 symbols, ids 0..63


def char_codec():
    return (lambda s: [ALPHABET.index(c) for c in s]), (lambda ids: "".join(ALPHABET[i] for i in ids))


def char_model(pos_encoding, seed):
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            block_size=L,
            vocab_size=len(ALPHABET),
            n_layer=2,
            n_head=2,
            n_embd=32,
            pos_encoding=pos_encoding,
            attn_backend="torch",
        )
    )
    with torch.no_grad():  # peaked attention; blocks that outweigh the (tied) token embedding, so the
        for block in model.transformer.h:  # argmax is not just the current token; confident logits
            block.attn.c_attn.weight.mul_(6.0)
            block.attn.c_proj.weight.mul_(10.0)
            block.mlp.c_proj.weight.mul_(10.0)
        model.transformer.ln_f.weight.mul_(30.0)
    return model.eval()


def test_is_greedy_only_when_every_continuation_token_is_the_argmax():
    """Continuations built token by token from the model's own argmaxes: all of them greedy (True);
    the last, the first, or a middle token not the argmax (False) while the others are."""
    encode, decode = char_codec()
    model = char_model("rope", seed=4)
    lm = ed.gpt_lm_class()(model, encode, decode, eot_token_id=63, batch_size=4)
    ctx = encode("the cat sat")

    def argmax(ids):
        return int(reference_logprobs(model, ids)[-1].argmax())

    def other(ids):
        return (argmax(ids) + 1) % len(ALPHABET)

    g = greedy_reference(model, ctx, 3)
    x0, m1 = other(ctx), other(ctx + g[:1])
    conts = [
        (g, True),
        (g[:2] + [other(ctx + g[:2])], False),
        ([x0, argmax(ctx + [x0])], False),
        ([g[0], m1, argmax(ctx + [g[0], m1])], False),
    ]
    got = lm.loglikelihood(instances("loglikelihood", [(decode(ctx), decode(c)) for c, _ in conts]), disable_tqdm=True)
    for (cont, want), (ll, greedy) in zip(conts, got):
        lp = reference_logprobs(model, (ctx + cont)[:-1])[-len(cont) :]
        assert greedy is want and ll == pytest.approx(
            float(lp.gather(1, torch.tensor(cont)[:, None]).sum()), rel=1e-6, abs=1e-5
        )


def successor_model():
    """A model whose greedy next token is certain: token t is followed by t + 1 (mod the vocabulary).
    The blocks write nothing (zero output projections), so the final hidden state is RMSNorm(wte[t]);
    wte's rows have unit norm, and lm_head (untied) holds them shifted by one row, so the logit of
    t + 1 is the largest by a margin of ~60 (distinct random unit vectors in 32 dimensions)."""
    model = char_model("pope", seed=8)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
        wte = model.transformer.wte.weight
        wte.div_(wte.norm(dim=1, keepdim=True))
        model.lm_head.weight = torch.nn.Parameter(wte.roll(1, dims=0).clone())
    return model


def test_generation_stops_at_end_of_text():
    """EOT ends a generation whatever the task's stop strings: declare the k-th greedy token the EOT:
    the text is the k tokens before it, after k + 1 forward passes."""
    encode, decode = char_codec()
    model = successor_model()
    ids = encode("It was")
    gen = greedy_reference(model, ids, 8)
    assert gen == [(ids[-1] + i) % len(ALPHABET) for i in range(1, 9)]  # distinct: the EOT's first occurrence
    k = 3
    lm = ed.gpt_lm_class()(model, encode, decode, eot_token_id=gen[k])
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    got = lm.generate_until(
        instances("generate_until", [("It was", {"until": ["#"], "max_gen_toks": 8})]), disable_tqdm=True
    )
    hook.remove()
    assert got == [decode(gen[:k])] and len(calls) == k + 1


def test_max_gen_toks_past_block_size_generates_block_size_minus_one_tokens():
    """max_gen_toks=100 > block_size 16: 15 new tokens after the context's last token (context +
    generation = 16 tokens), the same as max_gen_toks=15; max_gen_toks=4 keeps the last 12."""
    encode, decode = char_codec()
    model = char_model("rope", seed=6)
    context = "It was the best of times it was the worst"
    ids = encode(context)
    gen15, gen4 = greedy_reference(model, ids[-1:], L - 1), greedy_reference(model, ids[-(L - 4) :], 4)
    eot = min(set(range(len(ALPHABET))) - set(gen15) - set(gen4))  # never generated here
    lm = ed.gpt_lm_class()(model, encode, decode, eot_token_id=eot)
    reqs = [(context, {"until": ["#"], "max_gen_toks": n}) for n in (100, L - 1, 4)]
    got = lm.generate_until(instances("generate_until", reqs), disable_tqdm=True)
    assert got == [decode(gen15), decode(gen15), decode(gen4)] and len(got[0]) == L - 1
