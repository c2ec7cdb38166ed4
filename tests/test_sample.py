"""sample.py as a command, on a run folder trained for one step on indirect indexing."""

import os
import subprocess
import sys

import pytest
import torch

import train
from checkpoint import load_run
from prepare.indirect_indexing import PAD_ID, VOCAB

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "NZTUIGWkXFrhCJDzscat,N,+4,"


@pytest.fixture(scope="module")
def run_dir(tiny_indirect, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("run"))
    train.main(
        [
            "--n_layer=2",
            "--n_head=2",
            "--n_embd=32",
            "--batch_size=8",
            "--eval_iters=1",
            "--max_iters=1",
            "--eval_interval=1",
            "--attn_backend=torch",
            "--compile=False",
            f"--data_root={tiny_indirect}",
            "--dataset=indirect_indexing",
            "--block_size=64",
            f"--out_dir={out}",
        ]
    )
    return out


def sample(*args):
    p = subprocess.run(
        [sys.executable, "sample.py", "--device=cpu", "--attn_backend=torch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split("\n---------------\n")[:-1]


def test_sampled_text_keeps_the_prompt_and_prints_no_padding(run_dir, tmp_path):
    """Near-uniform sampling (temperature 50, no top-k) over the 128-id padded vocabulary draws the
    pad id (65) and unused ids (66..127) many times in 3 x 300 tokens; none of them is printed."""
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    outs = sample(
        f"--out_dir={run_dir}",
        f"--start=FILE:{prompt_file}",
        "--num_samples=3",
        "--max_new_tokens=300",
        "--temperature=50",
        "--top_k=0",
    )
    assert len(outs) == 3
    for text in outs:
        assert text.startswith(PROMPT)
        assert "<pad>" not in text and set(text) <= set(VOCAB)
        assert len(PROMPT) + 100 < len(text) < len(PROMPT) + 300  # some ids were dropped, most were letters


def test_temperature_zero_is_the_greedy_continuation(run_dir):
    """--temperature=0: every sample is the argmax continuation, computed here with full forwards."""
    outs = sample(
        f"--out_dir={run_dir}",
        f"--start={PROMPT}",
        "--num_samples=3",
        "--max_new_tokens=12",
        "--temperature=0",
        "--seed=5",
    )
    model, _ = load_run(run_dir, "best.pt", "cpu", attn_backend="torch")
    idx = torch.tensor([[VOCAB.index(c) for c in PROMPT]])
    with torch.no_grad():
        for _ in range(12):
            idx = torch.cat((idx, model(idx)[0][:, -1:].argmax(-1)), 1)
    want = "".join(VOCAB[i] for i in idx[0].tolist() if i < PAD_ID)
    assert outs == [want] * 3


def test_top_k_one_is_greedy_and_the_seed_fixes_the_samples(run_dir, capsys):
    """In-process (cheaper than a command): top_k=1 at temperature 1 equals temperature 0; at
    temperature 1 the same --seed gives the same samples and another seed other ones."""
    import sample as sample_mod

    common = [
        f"--out_dir={run_dir}",
        f"--start={PROMPT}",
        "--num_samples=2",
        "--max_new_tokens=20",
        "--device=cpu",
        "--attn_backend=torch",
    ]
    greedy = sample_mod.main(common + ["--temperature=0"])
    assert sample_mod.main(common + ["--temperature=1.0", "--top_k=1", "--seed=3"]) == greedy
    a = sample_mod.main(common + ["--temperature=1.0", "--top_k=0", "--seed=3"])
    assert sample_mod.main(common + ["--temperature=1.0", "--top_k=0", "--seed=3"]) == a
    assert sample_mod.main(common + ["--temperature=1.0", "--top_k=0", "--seed=4"]) != a != greedy


def test_sample_runs_in_the_dtype_it_is_given(run_dir, monkeypatch, capsys):
    """--dtype goes through cli.resolve_dtype like train.py's: the logits come out in bf16 under
    --dtype=bfloat16, in fp32 under 'auto' on a CPU; a name it does not know exits 2 with one line."""
    import sample as sample_mod

    seen = []

    def load_run_with_hook(*args, **kwargs):
        model, state = load_run(*args, **kwargs)
        model.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        return model, state

    monkeypatch.setattr(sample_mod, "load_run", load_run_with_hook)
    common = [f"--out_dir={run_dir}", f"--start={PROMPT}", "--max_new_tokens=2", "--device=cpu", "--attn_backend=torch"]
    sample_mod.main(common + ["--dtype=bfloat16"])
    assert seen and set(seen) == {torch.bfloat16}
    seen.clear()
    sample_mod.main(common)
    assert seen and set(seen) == {torch.float32}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        sample_mod.main(common + ["--dtype=fp16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "dtype must be 'auto' or one of" in err


@pytest.mark.parametrize(
    "arg,words",
    [
        ("--top_k=-2", "top_k >= 0"),
        ("--num_samples=0", "num_samples >= 1"),
        ("--max_new_tokens=-3", "max_new_tokens >= 0"),
        ("--start=", "prompt is empty"),
        ("--start=FILE:no/such/prompt.txt", "cannot read the prompt file 'no/such/prompt.txt'"),
        ("--start=FILE:binary.bin", "cannot read the prompt file 'binary.bin' as UTF-8"),
    ],
)
def test_bad_sampling_settings_exit_2_with_one_line(run_dir, capsys, arg, words, tmp_path, monkeypatch):
    import sample as sample_mod

    (tmp_path / "binary.bin").write_bytes(b"\xff\xfe\x00 not text")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        sample_mod.main(
            [
                f"--out_dir={run_dir}",
                f"--start={PROMPT}",
                "--max_new_tokens=2",
                "--device=cpu",
                "--attn_backend=torch",
                arg,
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_top_k_none_keeps_every_token_as_zero_and_the_whole_vocabulary_do():
    """complete(top_k=None), the function's documented "every token", samples as top_k=0 and as top_k = the
    vocabulary size (which keeps every token by definition); top_k=1 is greedy and differs at this temperature."""
    from model import GPT, GPTConfig
    from sample import complete

    torch.manual_seed(0)
    # 300 ids: more than sample.py's default top_k (200), so "every token" and "the default" differ
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=300, pos_encoding="pope")).eval()
    encode, decode = (lambda s: [int(c) for c in s]), (lambda ids: " ".join(map(str, ids)))
    kw = dict(max_new_tokens=24, temperature=3.0, num_samples=3, seed=7, device="cpu")
    every = complete(model, encode, decode, "1234", top_k=None, **kw)
    assert len(every) == 3 and all(s.startswith("1 2 3 4 ") for s in every) and len(set(every)) > 1
    assert every == complete(model, encode, decode, "1234", top_k=0, **kw)
    assert every == complete(model, encode, decode, "1234", top_k=300, **kw)
    assert every != complete(model, encode, decode, "1234", top_k=200, **kw)
    assert every != complete(model, encode, decode, "1234", top_k=1, **kw)
    with pytest.raises(ValueError, match="top_k >= 0"):
        complete(model, encode, decode, "1234", top_k=-1, **kw)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("max_new_tokens", [0, 1, 4])
def test_generate_runs_the_prompt_once_and_one_step_per_token_but_the_last(monkeypatch, compile, max_new_tokens):
    """GPT.generate runs the model max(1, max_new_tokens) times: the prompt once (all its tokens in one forward),
    then one single-token step for each new token but the last, whose logits nothing would read; the cache ends
    holding the prompt and every new token but the last. compile=True runs the same steps through
    compiled_decode_step (here the eager decode_step, counted: the real compiled step's positions and logits are
    test_decode_compiled.py's, which compiles it). The greedy tokens equal the full forward's argmax, step by
    step."""
    from model import GPT, GPTConfig, KVCache

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            n_layer=1,
            n_head=2,
            n_embd=32,
            block_size=32,
            vocab_size=37,
            pos_encoding="pope",
            attn_backend="torch",
            dropout=0.0,
        )
    ).eval()
    widths, caches = [], []
    model.transformer.h[0].register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    real_cache = KVCache.__init__
    monkeypatch.setattr(KVCache, "__init__", lambda self, *a: caches.append(self) or real_cache(self, *a))
    steps = []
    monkeypatch.setattr(
        model,
        "compiled_decode_step",
        lambda cache: lambda idx, c, pos: steps.append(int(pos)) or model.decode_step(idx, c, pos),
    )
    idx = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(1))
    out = model.generate(idx, max_new_tokens, temperature=0.0, compile=compile)
    assert out.shape == (2, 5 + max_new_tokens) and torch.equal(out[:, :5], idx)
    n_steps = max(max_new_tokens - 1, 0)
    if compile:
        assert widths == [5] and steps == list(range(5, 5 + n_steps))
    else:
        assert widths == [5] + [1] * n_steps and not steps
    (cache,) = caches
    assert cache.q_offset == 5 + n_steps
    with torch.no_grad():
        for t in range(5, out.shape[1]):
            assert torch.equal(out[:, t], model(out[:, :t])[0][:, -1].argmax(-1))


# ---- issue 61: --compile reaches generate; an unset --compile resolves on the run's device -------------------------


def _spy_generate(monkeypatch):
    """GPT.generate spied: records each call's `compile` and runs the real (eager) generate."""
    from model import GPT

    seen, real = [], GPT.generate

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, compile=False):
        seen.append(compile)
        return real(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, compile=False)

    monkeypatch.setattr(GPT, "generate", generate)
    return seen


@pytest.mark.parametrize("arg,want", [("--compile=True", True), ("--compile=False", False), (None, False)])
def test_compile_reaches_generate_through_the_real_main_and_complete(run_dir, monkeypatch, arg, want):
    """sample.main -> complete -> model.generate(compile=...): --compile=True and False arrive as given; unset on a
    CPU run is off (cli.resolve_compile: on for CUDA only). complete passes its own `compile` the same way."""
    import sample as sample_mod

    seen = _spy_generate(monkeypatch)
    common = [f"--out_dir={run_dir}", f"--start={PROMPT}", "--max_new_tokens=2", "--device=cpu", "--attn_backend=torch"]
    sample_mod.main(common + ([arg] if arg else []))
    assert seen == [want]
    model, state = load_run(run_dir, "best.pt", "cpu", attn_backend="torch")
    stoi = {c: i for i, c in enumerate(VOCAB)}
    for flag in (True, False):
        seen.clear()
        sample_mod.complete(model, lambda s: [stoi[c] for c in s], str, PROMPT, 2, compile=flag)
        assert seen == [flag]


@pytest.mark.parametrize("arg,want", [(None, True), ("--compile=False", False)])
def test_an_unset_compile_resolves_on_the_runs_device_not_its_setting(run_dir, monkeypatch, arg, want):
    """--device=auto on a machine with a GPU: the run's device is 'cuda', so an unset --compile is on (resolved on
    the device main resolved, not on the text 'auto'); --compile=False stays off. CUDA is faked minimally: torch
    says it has a GPU, load_run loads on the CPU, and complete (which would put tensors on the GPU) is spied."""
    import sample as sample_mod

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sample_mod, "load_run", lambda out, ckpt, dev, **kw: load_run(out, ckpt, "cpu", **kw))
    monkeypatch.setattr(sample_mod, "complete", lambda *a, **kw: calls.append((a[9], kw["compile"])) or ["x"])
    args = [f"--out_dir={run_dir}", f"--start={PROMPT}", "--device=auto", "--dtype=float32"]
    sample_mod.main(args + ([arg] if arg else []))
    assert calls == [("cuda", want)]
