"""eval_retrieval.py: the passkey and copy generators against hand-worked windows, the scorer on an
induction oracle built to retrieve and on one built to fail, and the command line end to end."""

import csv
import os

import numpy as np
import pytest
import torch
from scipy import stats

import eval_retrieval as er
from model import GPT, GPTConfig

KEY_42 = " The pass key is 42. Remember it. 42 is the pass key."
QUESTION = " What is the pass key? The pass key is"


def chars(s):
    """A stand-in encoder whose token ids are the characters themselves."""
    return list(s)


# ---- generators, by hand ----------------------------------------------------------------------


def test_the_prompt_strings_are_landmark_attentions():
    assert er.KEY_SENTENCE.format(key="42") == KEY_42
    assert er.QUESTION == QUESTION
    assert "".join(er.FILLER_SENTENCES) == (
        " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    )


def test_filler_stream_is_cut_from_the_left_with_its_sentence_boundaries():
    # one cycle is 20 + 17 + 19 + 12 + 22 = 90 characters; the last 40 of it: "ellow." + two sentences
    ids, bounds = er.filler_stream([chars(s) for s in er.FILLER_SENTENCES], 40)
    assert "".join(ids) == "ellow. Here we go. There and back again."
    assert bounds == [6, 18, 40]  # not 0: a key sentence there would run into the fragment "ellow."
    ids, bounds = er.filler_stream([chars(s) for s in er.FILLER_SENTENCES], 90)  # one whole cycle
    assert bounds == [0, 20, 37, 56, 68, 90]
    ids, bounds = er.filler_stream([chars(s) for s in er.FILLER_SENTENCES], 0)
    assert ids == [] and bounds == [0]


@pytest.mark.parametrize("depth,key_pos", [(0.0, 6), (0.25, 6), (0.5, 18), (0.75, 40), (1.0, 40)])
def test_passkey_window_by_hand(depth, key_pos):
    """n_filler = 40: boundaries 6, 18, 40 (the filler is cut from the left: "ellow." is a fragment, and
    a key sentence at 0 would run into it mid-word); depth 0 -> 0 -> 6, after the fragment and before the
    whole " Here we go."; 0.25 -> 10 -> 6 (nearer than 18); 0.5 -> 20 -> 18; 0.75 -> 30 -> 40
    (|40 - 30| = 10 < |18 - 30| = 12)."""
    length = 40 + len(KEY_42) + len(QUESTION) + len(" 42") - 1
    x, answer, p = er.passkey_window(chars, "42", length, depth)
    fill = "ellow. Here we go. There and back again."
    assert p == key_pos and answer == list(" 42") and len(x) == length
    assert "".join(x) == fill[:key_pos] + KEY_42 + fill[key_pos:] + QUESTION + " 4"
    after = "".join(x[key_pos + len(KEY_42) :])  # what follows the key sentence: a whole sentence, then the question
    assert after.startswith((" Here we go.", " There and back again.", QUESTION)), after


def test_passkey_window_too_short_is_a_user_error():
    length = len(KEY_42) + len(QUESTION) + 2
    x, _, p = er.passkey_window(chars, "42", length, 0.5)  # no filler at all still fits
    assert p == 0 and "".join(x) == KEY_42 + QUESTION + " 4"
    with pytest.raises(er.UserError, match="shorter than the passkey prompt"):
        er.passkey_window(chars, "42", length - 1, 0.5)


def test_key_alphabet_digits_where_spelled_else_letters():
    assert er.key_alphabet({"tokenizer": {"kind": "gpt2"}}) == "0123456789"
    assert er.key_alphabet({"tokenizer": {"kind": "char", "itos": list(" .0123456789abc")}}) == "0123456789"
    assert er.key_alphabet({"tokenizer": {"kind": "char", "itos": list(" .012345678abcT")}}) == "abc"
    with pytest.raises(er.UserError, match="text tokenizer"):
        er.key_alphabet({"tokenizer": {"kind": "none"}})


@pytest.mark.parametrize(
    "length,x,y",
    [
        (7, [10, 11, 12, 13, 10, 11, 12], [11, 12, 13, 10, 11, 12, 13]),
        (6, [10, 11, 12, 13, 10, 11], [11, 12, 13, 10, 11, 12]),
    ],
)
def test_copy_window_offsets_by_hand(length, x, y):
    """m = ceil((L + 1) / 2) = 4 for L = 6 and 7; the second copy's scored targets are y[4:]: the
    tokens 11, 12, (13) of the second copy, each 4 positions after its first occurrence."""
    got_x, got_y, m = er.copy_window(np.array([10, 11, 12, 13]), length)
    assert (got_x.tolist(), got_y.tolist(), m) == (x, y, 4)
    assert got_y[m:].tolist() == [11, 12, 13][: length - m]
    for t in range(m, length):  # the target at t is the token the input held m positions earlier
        assert got_y[t] == got_x[t + 1 - m]
    with pytest.raises(ValueError, match="needs a sequence of 4"):
        er.copy_window(np.array([10, 11, 12]), length)


# ---- the scorer: an induction oracle -----------------------------------------------------------


class OneHotHead(torch.nn.Module):
    """lm_head of the oracle: a hidden state holding a token id (as a float) -> logits 10 x one-hot."""

    def __init__(self, vocab):
        super().__init__()
        self.out_features = vocab

    def forward(self, h):
        return 10.0 * torch.nn.functional.one_hot(h[..., 0].long(), self.out_features).float()


class InductionOracle(torch.nn.Module):
    """Predicts the token that followed the most recent earlier occurrence of the last k tokens (an
    induction head, Olsson et al. 2022), looking back at most `window` tokens (None: all); where nothing
    matches, it predicts token 0. Its hidden state at each position is the predicted id, and its lm_head
    turns that into logits 10 x one-hot, so it plugs into er.score_last like a GPT."""

    def __init__(self, vocab, k, window=None):
        super().__init__()
        self.k, self.window = k, window
        self.lm_head = OneHotHead(vocab)

    def hidden_states(self, x):
        B, T = x.shape
        match = torch.ones(B, T, T, dtype=torch.bool)  # match[b, t, j]: x[t-i] == x[j-i] for i < k
        for i in range(self.k):
            a = torch.full((B, T), -1, dtype=x.dtype)
            a[:, i:] = x[:, : T - i]
            match &= (a[:, :, None] == a[:, None, :]) & (a[:, :, None] >= 0)
        t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        ok = (j < t) & ((t - j <= self.window) if self.window else torch.ones_like(match[0]))
        match &= ok
        j_best = torch.where(match, j.expand(T, T), -1).max(-1).values  # (B, T), -1 where none
        pred = torch.where(j_best >= 0, torch.gather(x, 1, (j_best + 1).clamp(max=T - 1)), 0)
        return pred.unsqueeze(-1).float()


def char_encoder():
    itos = sorted(set("".join(er.FILLER_SENTENCES) + er.KEY_SENTENCE + er.QUESTION + "0123456789"))
    return len(itos), lambda s: [itos.index(c) for c in s]


def test_passkey_scorer_on_an_oracle_that_retrieves_and_one_that_cannot_reach_the_key():
    vocab, encode = char_encoder()
    lengths, depths = [160, 320], [0.0, 0.5, 1.0]
    good = er.run_passkey(InductionOracle(vocab, k=8), encode, er.DIGITS, lengths, depths, 3, 5, 0, 320)
    assert {v[:2] for v in good.values()} == {(3, 3)}
    # the answer's tokens are predicted from x's last 5 positions; the k-gram "s key is" that leads back
    # to the key ends 15 tokens into the key sentence: the oracle needs L - 6 - (key_pos + 15) <= window.
    # By hand: key sentence 59 characters, question 38, answer 6: n_filler = L - 102; at L = 160 the filler
    # is "blue." + 3 sentences (boundaries 5, 24, 36, 58: not 0, the fragment), depth 0 -> 5, 0.5 -> 29 -> 24;
    # at L = 320, 218 characters: "low." + 2 cycles + 2 sentences (boundaries 4, ..., 94, 106, 128, ...),
    # depth 0 -> 4, depth 0.5 -> 109 -> 106
    near = er.run_passkey(InductionOracle(vocab, k=8, window=150), encode, er.DIGITS, lengths, depths, 3, 5, 0, 320)
    reach = {(L, d): L - 6 - er.passkey_window(encode, "12345", L, d)[2] - 15 for L in lengths for d in depths}
    assert reach == {(160, 0.0): 134, (160, 0.5): 115, (160, 1.0): 81, (320, 0.0): 295, (320, 0.5): 193, (320, 1.0): 81}
    assert {c: v[0] for c, v in near.items()} == {c: 3 if r <= 150 else 0 for c, r in reach.items()}


def test_passkey_scorer_exact_match_needs_every_answer_token():
    """A model right on all answer tokens but the last scores 0: exact match, not per-token credit."""
    vocab, encode = char_encoder()
    x, a, _ = er.passkey_window(encode, "12345", 160, 0.5)

    class AllButLast(InductionOracle):
        def hidden_states(self, x):
            h = super().hidden_states(x)
            h[:, -1] = (a[-1] + 1) % vocab  # the last answer token wrong
            return h

    assert er.passkey_correct(InductionOracle(vocab, k=8), [(x, a, 0)]) == [True]
    assert er.passkey_correct(AllButLast(vocab, k=8), [(x, a, 0)]) == [False]


def test_copy_scorer_on_an_oracle_that_copies_and_one_whose_window_is_too_short():
    """k = 3 over 64 ids: the oracle gets every second-copy target but the first two (their 3-grams
    straddle the copies' seam), so accuracy (L - m - 2) / (L - m); the first copy is at chance.
    With a window of 30 < m it never sees the first copy: the second is at chance too."""
    ids = np.arange(64)
    for L in (64, 128):
        m = (L + 2) // 2
        good = er.run_copy(InductionOracle(64, k=3), ids, [L], 4, 0, 128)[L]
        assert good["distance"] == m and good["targets"] == 4 * (L - m)
        assert abs(good["acc_second"] - (L - m - 2) / (L - m)) < 0.02 and good["acc_first"] < 0.2
        # logits 10 x one-hot over 64 ids: a right guess costs log(1 + 63 e^-10), a wrong one log(e^10 + 63)
        right, wrong = np.log1p(63 * np.exp(-10)), np.log(np.exp(10) + 63)
        assert abs(good["loss_second"] - ((L - m - 2) * right + 2 * wrong) / (L - m)) < 0.15
        bad = er.run_copy(InductionOracle(64, k=3, window=30), ids, [L], 4, 0, 128)[L]
        assert bad["acc_second"] < 0.2 and bad["loss_second"] > good["loss_second"] + 2


def test_score_last_matches_full_logits_of_a_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=40, n_layer=1, n_head=2, n_embd=16, pos_encoding="rope")).eval()
    x, y = torch.randint(0, 40, (2, 24)), torch.randint(0, 40, (2, 5))
    loss, hit = er.score_last(model, x, y)
    logits, _ = model(x)
    ref = torch.nn.functional.cross_entropy(logits[:, -5:].reshape(-1, 40).double(), y.reshape(-1), reduction="none")
    assert torch.allclose(loss.double().view(-1), ref, atol=1e-5)
    assert torch.equal(hit, logits[:, -5:].argmax(-1) == y)


# ---- the command line --------------------------------------------------------------------------


def save_run(folder, tokenizer, vocab_size, pos_encoding="rope", block_size=64, **config):
    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size,
        n_layer=1,
        n_head=2,
        n_embd=16,
        pos_encoding=pos_encoding,
        **config,
    )
    os.makedirs(folder, exist_ok=True)
    from dataclasses import asdict

    torch.save(
        {"model": GPT(cfg).state_dict(), "model_args": asdict(cfg), "config": {}, "tokenizer": tokenizer},
        os.path.join(folder, "best.pt"),
    )
    return folder


def rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_command_line_writes_tables_csvs_and_plot(tmp_path, capsys):
    itos = sorted(set("".join(er.FILLER_SENTENCES) + er.KEY_SENTENCE + er.QUESTION + "0123456789"))
    tok = {"dataset": "c", "vocab_size": len(itos), "pad_id": None, "tokenizer": {"kind": "char", "itos": itos}}
    a = save_run(str(tmp_path / "a"), tok, len(itos), block_size=128)  # context 64 refuses passkey (issue 53)
    b = save_run(str(tmp_path / "b"), tok, len(itos), pos_encoding="learned")
    out = str(tmp_path / "out")
    er.main(
        [a, b, "--lengths=128,256", "--depths=0,1", "--trials=3", "--copy_trials=2", f"--out_dir={out}", "--device=cpu"]
    )
    text = capsys.readouterr().out
    assert "keys of 5 symbols from '0123456789'" in text and "| 128 |" in text and "| 256 |" in text
    pk, cp = rows(os.path.join(out, "passkey.csv")), rows(os.path.join(out, "copy.csv"))
    assert [(r["run"], r["length"], r["depth"]) for r in pk] == [
        (a, "128", "0"),
        (a, "128", "1"),
        (a, "256", "0"),
        (a, "256", "1"),
    ]  # learned: none past 64
    for r in pk:
        k, n = int(r["correct"]), int(r["trials"])
        ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
        assert n == 3 and abs(float(r["ci_low"]) - ci.low) < 1e-5 and abs(float(r["ci_high"]) - ci.high) < 1e-5
    assert [(r["length"], r["distance"], r["targets"]) for r in cp] == [("128", "65", "126"), ("256", "129", "254")]
    assert os.path.getsize(os.path.join(out, "retrieval.png")) > 0
    # the same seed gives the same numbers
    er.main(
        [
            a,
            "--lengths=128",
            "--depths=0,1",
            "--trials=3",
            "--tasks=copy",
            "--copy_trials=2",
            f"--out_dir={out}2",
            "--device=cpu",
        ]
    )
    assert rows(os.path.join(out + "2", "copy.csv"))[0]["loss_second"] == cp[0]["loss_second"]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--lengths=50,60"], "every length is shorter than the passkey prompt without filler (102 tokens)"),
        (["--depths=0,1.5"], "--depths must lie in"),
        (["--trials=0"], "--trials must be >= 1"),
        (["--tasks=needle"], "--tasks must name"),
        (["--lengths=2,128", "--tasks=copy"], "copying needs windows of at least 3 tokens"),  # was a ValueError
        (["--multiples=0.01,1", "--tasks=copy"], "a token after its first), got 1:"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, extra, message):
    itos = sorted(set("".join(er.FILLER_SENTENCES) + er.KEY_SENTENCE + er.QUESTION + "0123456789"))
    tok = {"dataset": "c", "vocab_size": len(itos), "pad_id": None, "tokenizer": {"kind": "char", "itos": itos}}
    a = save_run(str(tmp_path / "a"), tok, len(itos))
    with pytest.raises(SystemExit) as e:
        er.main([a, "--trials=1", "--copy_trials=1", f"--out_dir={tmp_path / 'o'}", "--device=cpu", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_passkey_skips_the_lengths_its_prompt_does_not_fit_and_copy_runs_them(tmp_path, capsys):
    """Lengths 64 and 96 are shorter than the 102-character passkey prompt (5-digit key), so passkey starts at
    the first length that holds it (128, within the run's context of 128) while copying covers every length."""
    itos = sorted(set("".join(er.FILLER_SENTENCES) + er.KEY_SENTENCE + er.QUESTION + "0123456789"))
    tok = {"dataset": "c", "vocab_size": len(itos), "pad_id": None, "tokenizer": {"kind": "char", "itos": itos}}
    a = save_run(str(tmp_path / "a"), tok, len(itos), block_size=128)
    pk, cp = er.run(
        [
            a,
            "--lengths=64,96,128",
            "--depths=0",
            "--trials=1",
            "--copy_trials=1",
            f"--out_dir={tmp_path / 'o'}",
            "--device=cpu",
        ]
    )
    assert "passkey prompt needs 102 tokens: passkey at 64, 96 left empty" in capsys.readouterr().out
    assert [r["length"] for r in pk] == [128] and [r["length"] for r in cp] == [64, 96, 128]


def test_a_tokenizer_without_text_runs_copy_only(tmp_path, capsys):
    tok = {"dataset": "toy", "vocab_size": 16, "pad_id": None, "tokenizer": {"kind": "none"}}
    a = save_run(str(tmp_path / "a"), tok, 16, block_size=16)
    with pytest.raises(SystemExit) as e:
        er.main([a, f"--out_dir={tmp_path / 'o'}", "--device=cpu"])
    assert e.value.code == 2 and "--tasks=copy" in capsys.readouterr().err
    _, cp = er.run([a, "--tasks=copy", "--copy_trials=1", f"--out_dir={tmp_path / 'o'}", "--device=cpu"])
    assert [r["length"] for r in cp] == [16, 32, 64, 128, 256]


def test_gpt2_bpe_prompts_have_the_exact_length_and_the_oracle_retrieves_them():
    """GPT-2 BPE spells a 5-digit key in 2 or 3 tokens: every window still holds exactly L tokens, the
    answer is the key's own encoding, and the induction oracle (k = 3 tokens) gets every key."""
    from checkpoint import load_codec

    encode, decode = load_codec({"tokenizer": {"kind": "gpt2"}})
    rng = np.random.default_rng(0)
    for _ in range(6):
        key = er.random_key(rng, er.DIGITS, 5)
        for depth in (0.0, 0.5, 1.0):
            x, a, p = er.passkey_window(encode, key, 200, depth)
            assert len(x) == 200 and a == encode(" " + key)
            assert decode(x[p : p + len(encode(er.KEY_SENTENCE.format(key=key)))]) == er.KEY_SENTENCE.format(key=key)
            assert decode(x).endswith(er.QUESTION + decode(a[:-1]))
    res = er.run_passkey(InductionOracle(50257, k=3), encode, er.DIGITS, [200], [0.0, 1.0], 3, 5, 0, 200)
    assert {v[:2] for v in res.values()} == {(3, 3)}


# ---- issue 53: the real defects ----------------------------------------------------------------


def test_gpt2_bpe_a_length_shorter_than_the_longest_keys_prompt_is_left_empty_not_an_exit_2(tmp_path, capsys):
    """GPT-2 BPE spells "00000" in 28 prompt tokens and "00521" in 31 (36 % of 5-digit keys take 31): a
    length of 29 holds some keys and not others. It gets a note and no passkey row; the other lengths are
    scored (the prompt was sized from "00000", so 29 was not marked short and the first longer key exited 2)."""
    from checkpoint import load_codec

    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    q, a = len(encode(QUESTION)), len(encode(" 00000"))
    assert len(encode(er.KEY_SENTENCE.format(key="00000"))) + q + a - 1 == 28
    assert len(encode(er.KEY_SENTENCE.format(key="00521"))) + q + len(encode(" 00521")) - 1 == 31
    tok = {"dataset": "owt", "vocab_size": 50257, "pad_id": None, "tokenizer": {"kind": "gpt2"}}
    run = save_run(str(tmp_path / "a"), tok, 50257)
    pk, cp = er.main(
        [
            run,
            "--lengths=29,64",
            "--depths=0,1",
            "--trials=10",
            "--copy_trials=1",
            f"--out_dir={tmp_path / 'o'}",
            "--device=cpu",
        ]
    )
    assert "the passkey prompt needs 31 tokens: passkey at 29 left empty" in capsys.readouterr().out
    assert [(r["length"], r["trials"]) for r in pk] == [(64, 10), (64, 10)] and [r["length"] for r in cp] == [29, 64]


def test_passkey_beyond_the_training_context_at_every_depth_is_refused_in_one_line(tmp_path, capsys):
    """A context-64 character model (config/train_copy_cpu.py) at 2x and 4x. By hand, at L = 128: key sentence
    59, question 38, answer " 00521" 6 (5 in the window): 26 filler characters, the last 26 of the cycle,
    " go." + " There and back again." (boundaries 4, 26). The key " 00521" starts 16 characters into the key
    sentence and the answer's " " at 128 - 5 = 123. Depth 1: the key sentence at 26, its key at 42: 81
    characters before the answer; depth 0: the key sentence at 4 (after the fragment), 103 (107 before the
    fix put it at 0). Both exceed the 63 a context of 64 attends back: no passkey row, one note; copy runs.
    The same at --tasks=passkey alone: one line, exit 2. A context-128 run is scored at 128."""
    chars = list
    x, a, p = er.passkey_window(chars, "00521", 128, 1.0)
    assert p == 26 and "".join(x[42:48]) == " 00521" and len(x) - len(a) + 1 == 123
    assert er.answer_distance(chars, "00521", 128, 1.0) == 81 and er.answer_distance(chars, "00521", 128, 0.0) == 103
    assert er.answer_distance(chars, "00521", 256, 1.0) == 81  # at depth 1 the distance does not grow with L
    x, _, p = er.passkey_window(chars, "00521", 128, 0.0)
    assert p == 4 and "".join(x[:63]) == " go." + er.KEY_SENTENCE.format(key="00521")
    assert "".join(x[63:]).startswith(" There and back again. What is")

    itos = sorted(set("".join(er.FILLER_SENTENCES) + er.KEY_SENTENCE + er.QUESTION + "0123456789"))
    tok = {"dataset": "c", "vocab_size": len(itos), "pad_id": None, "tokenizer": {"kind": "char", "itos": itos}}
    a64 = save_run(str(tmp_path / "a64"), tok, len(itos), block_size=64)
    pk, cp = er.run(
        [a64, "--multiples=2,4", "--trials=2", "--copy_trials=1", f"--out_dir={tmp_path / 'o'}", "--device=cpu"]
    )
    notes = [line for line in capsys.readouterr().out.splitlines() if "refused" in line]
    assert notes == [
        f"note: {a64}: passkey refused at 128, 256: the key lies at least 81 tokens before its answer, "
        "beyond the 63 that a training context of 64 attends back, so it cannot be retrieved by construction"
    ]
    assert pk == [] and [r["length"] for r in cp] == [128, 256]
    assert not os.path.exists(tmp_path / "o" / "passkey.csv")
    with pytest.raises(SystemExit) as e:
        er.main(
            [a64, "--multiples=2,4", "--tasks=passkey", "--trials=1", f"--out_dir={tmp_path / 'o2'}", "--device=cpu"]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "passkey refused at every length" in err, err
    a128 = save_run(str(tmp_path / "a128"), tok, len(itos), block_size=128)
    pk, _ = er.run(
        [
            a128,
            "--lengths=128",
            "--depths=0,1",
            "--trials=1",
            "--tasks=passkey",
            f"--out_dir={tmp_path / 'o3'}",
            "--device=cpu",
        ]
    )
    assert [(r["length"], r["depth"]) for r in pk] == [
        (128, 0.0),
        (128, 1.0),
    ] and "refused" not in capsys.readouterr().out


def test_copy_defaults_to_200_sequences_with_a_wilson_interval_that_study_results_still_reads(tmp_path, capsys):
    """At least 200 copy sequences per length by default (8 added about 0.85 points of noise at 4x); each
    accuracy comes with its Wilson 95 % interval over the targets (scipy's, by hand: hits / targets), in the
    table and appended to copy.csv, which study/results.py --retrieval reads as before."""
    import results

    assert er.parse_args(["r"]).copy_trials >= 200
    tok = {"dataset": "t", "vocab_size": 16, "pad_id": None, "tokenizer": {"kind": "none"}}
    a = save_run(str(tmp_path / "a"), tok, 16, block_size=16)
    out = str(tmp_path / "o")
    _, cp = er.run([a, "--tasks=copy", "--lengths=16,32", f"--out_dir={out}", "--device=cpu"])
    table = capsys.readouterr().out
    got = rows(os.path.join(out, "copy.csv"))
    assert list(got[0])[:12] == [
        "run",
        "label",
        "length",
        "multiple",
        "distance",
        "trials",
        "targets",
        "loss_second",
        "acc_second",
        "loss_first",
        "acc_first",
        "seconds",
    ]  # the old columns, in place
    for r, L in zip(got, (16, 32)):
        k, n = int(r["hits_second"]), int(r["targets"])
        assert r["trials"] == "200" and n == 200 * (L - (L + 2) // 2)  # m = ceil((L + 1) / 2)
        ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
        assert float(r["acc_second"]) == pytest.approx(k / n, abs=1e-6)
        assert float(r["acc_second_low"]) == pytest.approx(ci.low, abs=1e-6)
        assert float(r["acc_second_high"]) == pytest.approx(ci.high, abs=1e-6)
        assert f"{k / n:.3f} ({ci.low:.3f}-{ci.high:.3f}) / " in table
        run = {"path": a, "out_dir": a, "retrieval_csv": {"copy": os.path.join(out, "copy.csv")}}
        assert results.retrieval_accuracy(run, "copy", L) == float(r["acc_second"])


# ---- issue 53, round six: behaviour the review's surviving plants showed unpinned -------------------


@pytest.mark.parametrize(
    "depth,key_pos", [(0.5625, 30), (0.3203125, 11), (0.828125, 42), (0.5703125, 42), (0.5546875, 30)]
)
def test_a_depth_exactly_between_two_boundaries_takes_the_earlier(depth, key_pos):
    """n_filler = 64: the last 64 characters of the filler cycle, "ky is blue." + three sentences, boundaries
    11, 30, 42, 64 (not 0: the fragment). depth x 64 exactly between two of them (dyadic depths, no rounding):
    36 between 30 and 42 -> 30, 20.5 between 11 and 30 -> 11, 53 between 42 and 64 -> 42 (ties: the earlier);
    36.5 and 35.5, just off the middle, go to the nearer (42, 30)."""
    fill = "ky is blue. The sun is yellow. Here we go. There and back again."
    length = 64 + len(KEY_42) + len(QUESTION) + len(" 42") - 1
    assert depth * 64 in (36, 20.5, 53, 36.5, 35.5)  # exact in binary floating point
    x, _, p = er.passkey_window(chars, "42", length, depth)
    assert p == key_pos and "".join(x) == fill[:key_pos] + KEY_42 + fill[key_pos:] + QUESTION + " 4"


class Scripted(torch.nn.Module):
    """A model that predicts, for each input row it knows (by its tokens), the ids in `script[tuple(row)]`
    (one per position): its hidden state is the id, its lm_head OneHotHead (logits 10 x one-hot)."""

    def __init__(self, vocab, script):
        super().__init__()
        self.script, self.lm_head = script, OneHotHead(vocab)

    def hidden_states(self, x):
        return torch.tensor([self.script[tuple(r)] for r in x.tolist()], dtype=torch.float32).unsqueeze(-1)


def test_answers_of_two_and_three_gpt2_tokens_are_scored_on_their_own_positions_in_one_batch():
    """GPT-2 BPE spells " 00000" in 2 tokens and " 00521" in 3: in one batch each window is scored on its
    own last len(answer) positions (the question's last token, then the answer but its last). A 2-token
    window wrong only at the position before those (where a 3-token answer starts) is still right; a
    3-token window wrong only there is wrong; each the same alone as in the batch."""
    from checkpoint import load_codec

    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    windows = [
        er.passkey_window(encode, k, 64, d)
        for k, d in (("00000", 0.0), ("00521", 0.5), ("00521", 1.0), ("00000", 1.0), ("00000", 0.5))
    ]
    assert [len(a) for _, a, _ in windows] == [2, 3, 3, 2, 2]
    wrong_at = [-3, -3, None, -1, -2]  # position (from the end) where each window's prediction is wrong
    script = {}
    for (x, a, _), w in zip(windows, wrong_at):
        pred = x[1:] + [a[-1]]  # the true next token everywhere: x ends with the answer but its last
        if w is not None:
            pred[w] = (pred[w] + 1) % 50257
        script[tuple(x)] = pred
    model = Scripted(50257, script)
    expected = [True, False, True, False, False]
    assert er.passkey_correct(model, windows) == expected
    assert [er.passkey_correct(model, [w])[0] for w in windows] == expected
    assert er.passkey_correct(model, windows[::-1]) == expected[::-1]


class Recorder(InductionOracle):
    """The induction oracle, keeping every input row it reads (in order)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.rows = []

    def hidden_states(self, x):
        self.rows += [tuple(r) for r in x.tolist()]
        return super().hidden_states(x)


def test_each_task_length_and_depth_draws_its_own_documented_stream():
    """passkey (task 0): the keys of (L, depth index j) from default_rng([seed, 0, L, j]), key_len draws of
    integers(0, len(alphabet)) per key; copy (task 1): default_rng([seed, 1, L]), one choice(ids, m) per
    sequence. By hand with numpy, for two lengths, three depths and batches that split the trials."""
    vocab, encode = char_encoder()
    seed, trials = 7, 3
    rec = Recorder(vocab, k=8)
    er.run_passkey(rec, encode, er.DIGITS, [160, 320], [0.0, 0.5, 1.0], trials, 5, seed, 320)
    want = []
    for L in (160, 320):
        for j, d in enumerate((0.0, 0.5, 1.0)):
            rng = np.random.default_rng([seed, 0, L, j])
            for _ in range(trials):
                key = "".join("0123456789"[i] for i in rng.integers(0, 10, 5))
                want.append(tuple(er.passkey_window(encode, key, L, d)[0]))
    assert rec.rows == want
    draws = np.random.default_rng([seed, 0, 320, 2]).integers(0, 10, (trials, 5))
    assert er.passkey_keys(er.DIGITS, 5, trials, seed, 320, 2) == ["".join(map(str, d)) for d in draws]
    ids = np.arange(3, 40)
    rec = Recorder(64, k=3)
    er.run_copy(rec, ids, [32, 63], 3, seed, 64)
    want = []
    for L in (32, 63):
        rng, m = np.random.default_rng([seed, 1, L]), -(-(L + 1) // 2)
        for _ in range(3):
            s = rng.choice(ids, m)
            want.append(tuple(np.concatenate([s, s])[:L].tolist()))
    assert rec.rows == want
    rec2 = Recorder(64, k=3)
    er.run_copy(rec2, ids, [63], 3, seed, 64)  # without the other length: the same sequences
    assert rec2.rows == want[3:]


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_an_absolute_encoding_keeps_its_row_at_exactly_block_size(tmp_path, capsys, pos_encoding):
    """A learned or sinusoidal run has positions 0 .. block_size - 1: a window of exactly block_size (64) is
    scored; 65 is left empty with a note."""
    tok = {"dataset": "t", "vocab_size": 16, "pad_id": None, "tokenizer": {"kind": "none"}}
    a = save_run(str(tmp_path / "a"), tok, 16, pos_encoding=pos_encoding, block_size=64)
    _, cp = er.run(
        [a, "--tasks=copy", "--lengths=32,64,65", "--copy_trials=2", f"--out_dir={tmp_path / 'o'}", "--device=cpu"]
    )
    assert [r["length"] for r in cp] == [32, 64] and all(0 <= r["acc_second"] <= 1 for r in cp)
    assert f"uses the absolute encoding {pos_encoding!r}: lengths 65 left empty" in capsys.readouterr().out


def test_a_length_that_exactly_holds_the_passkey_prompt_is_scored(tmp_path, capsys):
    """The prompt without filler is 102 characters with a 5-digit key (59 + 38 + 6 - 1): 102 is scored (no
    filler, the key sentence at 0), 101 is left empty with a note."""
    itos = sorted(set("".join(er.FILLER_SENTENCES) + er.KEY_SENTENCE + er.QUESTION + "0123456789"))
    tok = {"dataset": "c", "vocab_size": len(itos), "pad_id": None, "tokenizer": {"kind": "char", "itos": itos}}
    a = save_run(str(tmp_path / "a"), tok, len(itos), block_size=128)
    pk, _ = er.run(
        [
            a,
            "--lengths=101,102,128",
            "--depths=0,1",
            "--trials=2",
            "--tasks=passkey",
            f"--out_dir={tmp_path / 'o'}",
            "--device=cpu",
        ]
    )
    assert "passkey prompt needs 102 tokens: passkey at 101 left empty" in capsys.readouterr().out
    assert [(r["length"], r["depth"], r["trials"]) for r in pk] == [
        (102, 0.0, 2),
        (102, 1.0, 2),
        (128, 0.0, 2),
        (128, 1.0, 2),
    ]


def test_multiples_of_a_yarn_fine_tune_are_of_its_original_context(tmp_path, capsys):
    """A YaRN fine-tune (s = 4 from 32 to 128) trained at 32: --multiples=1,2,4 are 32, 64, 128 tokens, and
    the CSV's multiple is length / 32. A plain run with --rope_scaling=4 at evaluation: multiples of its
    block_size (32), which YaRN records as the original context."""
    tok = {"dataset": "t", "vocab_size": 16, "pad_id": None, "tokenizer": {"kind": "none"}}
    y = save_run(str(tmp_path / "y"), tok, 16, block_size=128, rope_scaling=4.0, rope_original_block_size=32)
    _, cp = er.run(
        [y, "--tasks=copy", "--multiples=1,2,4", "--copy_trials=1", f"--out_dir={tmp_path / 'o'}", "--device=cpu"]
    )
    assert [(r["length"], r["multiple"]) for r in cp] == [(32, 1.0), (64, 2.0), (128, 4.0)]
    assert f"lengths 32, 64, 128 (context 32 of {y})" in capsys.readouterr().out
    p = save_run(str(tmp_path / "p"), tok, 16, block_size=32)
    _, cp = er.run(
        [
            p,
            "--tasks=copy",
            "--multiples=1,4",
            "--rope_scaling=4",
            "--copy_trials=1",
            f"--out_dir={tmp_path / 'o2'}",
            "--device=cpu",
        ]
    )
    assert [(r["length"], r["multiple"]) for r in cp] == [(32, 1.0), (128, 4.0)]


@pytest.mark.parametrize(
    "meta,vocab_size,expected",
    [
        ({"pad_id": 0, "tokenizer": {"kind": "char", "itos": list("_abcdefg")}}, 8, [1, 2, 3, 4, 5, 6, 7]),
        ({"pad_id": 7, "tokenizer": {"kind": "char", "itos": list("abcdefg_")}}, 8, [0, 1, 2, 3, 4, 5, 6]),
        ({"pad_id": 3, "tokenizer": {"kind": "none"}}, 6, [0, 1, 2, 4, 5]),
        ({"pad_id": None, "tokenizer": {"kind": "none"}}, 4, [0, 1, 2, 3]),
        ({"pad_id": None, "tokenizer": {"kind": "char", "itos": list("abc")}}, 8, [0, 1, 2]),  # padded vocabulary
    ],
)
def test_copy_ids_leave_out_the_padding_id_wherever_it_is(meta, vocab_size, expected):
    assert er.copy_ids(meta, vocab_size).tolist() == expected


def test_gpt2_copy_ids_are_its_50257_tokens_without_the_padding_id():
    assert len(er.copy_ids({"pad_id": None, "tokenizer": {"kind": "gpt2"}}, 50304)) == 50257
    ids = er.copy_ids({"pad_id": 50256, "tokenizer": {"kind": "gpt2"}}, 50304)
    assert len(ids) == 50256 and ids[-1] == 50255


def test_copy_sequences_of_the_command_never_hold_the_padding_id(tmp_path, monkeypatch):
    """A run whose tokenizer pads with id 0 (of 6): every token the model reads in the copy test is one of
    1 .. 5, and each of them occurs."""
    seen = []
    score = er.score_last

    def recording(model, x, y):
        seen.append(x.clone())
        return score(model, x, y)

    monkeypatch.setattr(er, "score_last", recording)
    tok = {"dataset": "t", "vocab_size": 6, "pad_id": 0, "tokenizer": {"kind": "none"}}
    a = save_run(str(tmp_path / "a"), tok, 6, block_size=16)
    er.run([a, "--tasks=copy", "--lengths=16", "--copy_trials=20", f"--out_dir={tmp_path / 'o'}", "--device=cpu"])
    assert set(torch.cat(seen).unique().tolist()) == {1, 2, 3, 4, 5}


class Cheat(torch.nn.Module):
    """A copy-test model that knows the answer: right at the first copy's first target (t = 0), at the seam
    (t = m - 1, the first token of the second copy, which nothing can predict) and at the second copy's
    targets after its first (t > m); wrong at every other position (the right id + 1). Its hidden state is
    the predicted id; lm_head OneHotHead (logits 10 x one-hot)."""

    def __init__(self, vocab):
        super().__init__()
        self.lm_head = OneHotHead(vocab)

    def hidden_states(self, x):
        B, T = x.shape
        m = -(-(T + 1) // 2)
        truth = torch.cat([x[:, 1:], x[:, T - m : T - m + 1]], 1)  # the next token; the last one lies m back
        t = torch.arange(T)
        right = (t == 0) | (t == m - 1) | (t > m)
        pred = torch.where(right, truth, (truth + 1) % self.lm_head.out_features)
        return pred.unsqueeze(-1).float()


@pytest.mark.parametrize("L", [7, 8, 12])
def test_the_first_copy_baseline_and_the_second_copy_stop_short_of_the_seam(L):
    """The first copy's scored targets are t = 0 .. m - 2 (its tokens 1 .. m - 1), the second copy's
    t = m + 1 - 1 .. L - 1 (its tokens after the first); the target at t = m - 1 (the second copy's first
    token, after the seam) is in neither. By hand, with Cheat right at t = 0, m - 1 and t > m:
    acc_first = 1 / (m - 1), acc_second = (L - m - 1) / (L - m); losses from the one-hot logits."""
    V, m, trials = 16, -(-(L + 1) // 2), 3
    got = er.run_copy(Cheat(V), np.arange(V), [L], trials, 0, 16)[L]
    right, wrong = np.log1p((V - 1) * np.exp(-10)), np.log(np.exp(10) + V - 1)
    assert (got["distance"], got["targets"], got["hits_second"]) == (m, trials * (L - m), trials * (L - m - 1))
    assert got["acc_first"] == pytest.approx(1 / (m - 1))
    assert got["acc_second"] == pytest.approx((L - m - 1) / (L - m))
    assert got["loss_first"] == pytest.approx((right + (m - 2) * wrong) / (m - 1), rel=1e-5)
    assert got["loss_second"] == pytest.approx((wrong + (L - m - 1) * right) / (L - m), rel=1e-5)


def test_gpt2_the_passkey_prompt_is_sized_from_the_keys_of_every_scored_length_and_depth(tmp_path, capsys):
    """GPT-2 BPE spells the prompt of a 5-digit key in 28 or 31 tokens; a length of 30 is scored only where
    every key drawn, at every (length, depth index) stream default_rng([seed, 0, L, j]), takes 28 (the
    prompt is sized from the longest, issue 53). One key per cell, lengths 30 and 64, depths 0 and 1: the
    seeds below put the only 31-token key in a different cell each (22: none), so the note and the rows at 30
    follow the streams by hand."""
    from checkpoint import load_codec

    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    tok = {"dataset": "owt", "vocab_size": 50257, "pad_id": None, "tokenizer": {"kind": "gpt2"}}
    run = save_run(str(tmp_path / "a"), tok, 50257)
    cells = {}
    for seed in (22, 19, 11, 12):
        for L in (30, 64):
            for j in (0, 1):
                key = "".join(map(str, np.random.default_rng([seed, 0, L, j]).integers(0, 10, 5)))
                cells[seed, L, j] = len(encode(er.KEY_SENTENCE.format(key=key) + QUESTION)) + len(encode(" " + key)) - 1
        need = max(cells[seed, L, j] for L in (30, 64) for j in (0, 1))
        pk, _ = er.run(
            [
                run,
                "--lengths=30,64",
                "--depths=0,1",
                "--trials=1",
                "--tasks=passkey",
                f"--seed={seed}",
                f"--out_dir={tmp_path / 'o'}",
                "--device=cpu",
            ]
        )
        out = capsys.readouterr().out
        assert [r["length"] for r in pk] == ([30, 30] if need <= 30 else []) + [64, 64], (seed, need)
        assert ("passkey at 30 left empty" in out) == (need > 30)
    longest = {s: [c for c in ((30, 0), (30, 1), (64, 0), (64, 1)) if cells[(s, *c)] == 31] for s in (22, 19, 11, 12)}
    assert longest == {22: [], 19: [(64, 1)], 11: [(64, 0)], 12: [(30, 1)]}  # the seeds do their job


def test_gpt2_bpe_passkey_refusal_takes_the_nearest_keys_distance_and_refuses_at_exactly_block_size(tmp_path, capsys):
    """GPT-2 BPE spells a 5-digit key in 2 or 3 tokens, so the distance from the key to its answer depends on the key:
    at --seed=1, length 64, depth 1, the 3 keys drawn ("57511", "12322", "90977") lie 25, 23 and 25 tokens before
    their answers (answer_distance, checked here). The refusal takes the nearest (23), not the first or the farthest:
    a context of 24 attends 23 back, so it is scored; a context of exactly 23 attends 22, so it is refused (a distance
    equal to block_size is out of reach), and alone (--tasks=passkey) that is one line, exit 2."""
    from checkpoint import load_codec

    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    keys = er.passkey_keys("0123456789", 5, 3, 1, 64, 0)
    assert keys == ["57511", "12322", "90977"]
    assert [er.answer_distance(encode, k, 64, 1.0) for k in keys] == [25, 23, 25]
    tok = {"dataset": "owt", "vocab_size": 50257, "pad_id": None, "tokenizer": {"kind": "gpt2"}}
    args = ["--lengths=64", "--depths=1", "--trials=3", "--seed=1", "--tasks=passkey", "--device=cpu"]
    capsys.readouterr()
    run24 = save_run(str(tmp_path / "c24"), tok, 50257, block_size=24)
    pk, _ = er.run([run24, *args, f"--out_dir={tmp_path / 'o24'}"])
    assert [(r["length"], r["trials"]) for r in pk] == [(64, 3)] and "refused" not in capsys.readouterr().out
    run23 = save_run(str(tmp_path / "c23"), tok, 50257, block_size=23)
    with pytest.raises(SystemExit) as e:
        er.main([run23, *args, f"--out_dir={tmp_path / 'o23'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "passkey refused at every length: the key lies at least 23 tokens before its answer, beyond the 22" in err
