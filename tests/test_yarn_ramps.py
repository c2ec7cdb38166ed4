"""YaRN's two ramps (issue 60), each against a table worked by hand at head_dim 32, L = 256, s = 4,
rope_theta 10^4, and the checkpoints written before the setting existed, which keep the paper's ramp.

Per pair i: theta_i = 10^4^(-i/16) rad/token, lambda_i = 2 pi / theta_i tokens, r_i = 256 / lambda_i.
'paper' (Peng et al. 2024, NTK-by-parts): gamma = clamp((r - 1) / (32 - 1), 0, 1).
'code' (the released YaRN code, Hugging Face): r = n at i(n) = 32 ln(256 / (2 pi n)) / (2 ln 10^4);
i(32) = 32 ln(1.27324) / 18.4207 = 0.4196 -> floor 0, i(1) = 32 ln(40.7437) / 18.4207 = 6.4402 -> ceil 7,
gamma = 1 - clamp((i - 0) / (7 - 0), 0, 1).
theta'_i / theta_i = (1 - gamma) / 4 + gamma.

  i   lambda     r        paper gamma  ratio    code gamma  ratio
  0     6.283   40.7437   1            1        1           1
  1    11.173   22.9118   0.7068       0.7801   6/7         0.8929
  2    19.869   12.8843   0.3834       0.5375   5/7         0.7857
  3    35.333    7.2454   0.2015       0.4011   4/7         0.6786
  4    62.832    4.0744   0.0992       0.3244   3/7         0.5714
  5   111.733    2.2912   0.0417       0.2812   2/7         0.4643
  6   198.692    1.2884   0.0093       0.2570   1/7         0.3571
  7..15  >= 353   < 0.73  0            0.25     0           0.25
"""

import math
from dataclasses import asdict

import pytest
import torch

from checkpoint import load_checkpoint
from eval_extrapolate import encoding_label
from model import GPT, GPTConfig, rope_frequencies, yarn_correction_range

RATIO = {  # theta'_i / theta_i for pairs 0..7 (8..15 are 0.25 in both), from the table above
    "paper": [1.0, 0.7801, 0.5375, 0.4011, 0.3244, 0.2812, 0.2570, 0.25],
    "code": [1.0, 0.8929, 0.7857, 0.6786, 0.5714, 0.4643, 0.3571, 0.25],
}


def hand_ratio(i, ramp):
    """The table's row i in float64, written out with math only (not model.py)."""
    theta = 10000.0 ** (-2 * i / 32)
    r = 256 / (2 * math.pi / theta)
    if ramp == "paper":
        gamma = min(max((r - 1) / 31, 0.0), 1.0)
    else:
        low = math.floor(32 * math.log(256 / (2 * math.pi * 32)) / (2 * math.log(10000.0)))
        high = math.ceil(32 * math.log(256 / (2 * math.pi * 1)) / (2 * math.log(10000.0)))
        gamma = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
    return (1 - gamma) / 4 + gamma


@pytest.mark.parametrize("ramp", ["paper", "code"])
def test_each_ramp_matches_the_hand_worked_table(ramp):
    plain = rope_frequencies(32, 10000.0)
    got = rope_frequencies(32, 10000.0, scaling=4.0, original_block_size=256, ramp=ramp) / plain
    want = [hand_ratio(i, ramp) for i in range(16)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(got[:8], torch.tensor(RATIO[ramp], dtype=torch.float64), atol=5e-5, rtol=0)
    assert torch.all(got[8:] == 0.25)


def test_the_ramps_differ_in_pairs_1_to_6_as_the_issue_says():
    """Issue 60: at pair 3, 0.40 (paper) against 0.68 (code); equal at pairs 0 and 7..15."""
    paper, code = (rope_frequencies(32, 10000.0, 4.0, 256, ramp=r) / rope_frequencies(32, 10000.0) for r in RATIO)
    assert round(paper[3].item(), 2) == 0.40 and round(code[3].item(), 2) == 0.68
    differ = (code - paper).abs() > 1e-3
    assert differ.tolist() == [False] + [True] * 6 + [False] * 9


def test_the_code_ramps_range_and_its_equal_bounds_guard():
    """(low, high) = (floor(i(32)), ceil(i(1))) = (0, 7) at the table's setting; at head_dim 64, L = 1024
    (the OWT runs'): i(32) = 64 ln(1024 / 64 pi) / 18.4207 = 5.656 -> 5 (round would give 6), i(1) = 17.697 -> 18.
    At L = 4 < 2 pi every pair
    turns less than once: both bounds clamp to 0, and the code's guard (high = low + 0.001) keeps pair 0
    (gamma 1) and interpolates the rest, with no 0 / 0."""
    assert yarn_correction_range(32, 10000.0, 256) == (0, 7)
    assert yarn_correction_range(64, 10000.0, 1024) == (5, 18)
    got = rope_frequencies(8, 10000.0, scaling=4.0, original_block_size=4, ramp="code")
    want = torch.tensor([1.0, 0.1 / 4, 0.01 / 4, 0.001 / 4], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-15, rtol=1e-12)
    with pytest.raises(ValueError, match="'code' or 'paper'"):
        rope_frequencies(8, 10000.0, 4.0, 256, ramp="hf")
    with pytest.raises(ValueError, match="rope_yarn_ramp must be"):
        GPTConfig(n_layer=1, n_head=2, n_embd=16, rope_yarn_ramp="hf")


def test_new_runs_default_to_the_code_ramp_and_old_checkpoints_keep_the_papers(tmp_path):
    """GPTConfig's default is 'code'; a checkpoint written before the setting (no rope_yarn_ramp in its
    model_args) is read back with 'paper', the ramp it ran with, its rotation table too, and is labelled so."""
    assert GPTConfig().rope_yarn_ramp == "code"
    cfg = GPTConfig(
        block_size=16, vocab_size=11, n_layer=1, n_head=1, n_embd=32, pos_encoding="rope",
        rope_scaling=4.0, rope_original_block_size=256, rope_yarn_ramp="paper",
    )  # fmt: skip
    model = GPT(cfg)
    old_args = {k: v for k, v in asdict(cfg).items() if k != "rope_yarn_ramp"}
    torch.save({"model": model.state_dict(), "model_args": old_args}, tmp_path / "best.pt")
    state = load_checkpoint(str(tmp_path))
    assert state["model_args"]["rope_yarn_ramp"] == "paper"
    assert encoding_label(state["model_args"]) == "rope+yarn(s=4,paper)"
    assert encoding_label({**state["model_args"], "rope_yarn_ramp": "code"}) == "rope+yarn(s=4,code)"
    rebuilt = GPT(GPTConfig(**state["model_args"]))
    assert torch.equal(rebuilt.rotation, model.rotation)
    assert not torch.equal(GPT(GPTConfig(**{**old_args})).rotation, model.rotation)  # 'code' would differ


def test_a_yarn_run_saved_before_the_setting_resumes_with_the_papers_ramp(toy_stream, tmp_path):
    """train.py's resume: a YaRN run whose ckpt.pt predates rope_yarn_ramp (neither its model_args nor its config
    has it) goes on with 'paper', and records 'paper' in its config, although this train.py's default is 'code'."""
    import json
    import os

    from test_train import TINY, run

    out = str(tmp_path / "out")
    common = TINY + [
        f"--data_root={toy_stream}", "--dataset=toy", "--block_size=16", "--eval_interval=2", f"--out_dir={out}",
        "--pos_encoding=rope", "--rope_scaling=4.0", "--rope_original_block_size=4",
    ]  # fmt: skip
    run(common + ["--max_iters=2", "--rope_yarn_ramp=paper"])
    path = os.path.join(out, "ckpt.pt")
    state = torch.load(path, weights_only=True)
    del state["model_args"]["rope_yarn_ramp"], state["config"]["rope_yarn_ramp"]  # as the old version wrote it
    torch.save(state, path)
    paper_rotation = GPT(GPTConfig(**{**state["model_args"], "rope_yarn_ramp": "paper"})).rotation
    assert not torch.equal(paper_rotation, GPT(GPTConfig(**state["model_args"])).rotation)  # the ramps differ here
    run(common + ["--max_iters=4", "--init_from=resume"])
    state = torch.load(path, weights_only=True)
    assert state["iter_num"] == 4 and state["model_args"]["rope_yarn_ramp"] == "paper"
    with open(os.path.join(out, "metrics.json")) as f:
        assert json.load(f)["config"]["rope_yarn_ramp"] == "paper"


def test_the_code_ramps_upper_bound_at_a_large_original_context_is_in_channels():
    """The released code (find_correction_range; Hugging Face's _compute_yarn_parameters) clamps high to head_dim - 1,
    a channel index, not the last pair's: at a large original context L, i(1) passes the last pair and the ramp ends
    past it, so even the slowest pair keeps part of its frequency. By hand, rope_theta 10^4, i(n) = head_dim
    ln(L / (2 pi n)) / (2 ln 10^4):
      head_dim 64, L 65536: i(32) = 20.105 -> 20, i(1) = 32.146 -> 33 (> 31, the last pair; <= 63): pair 31 has
        gamma 1 - 11/13 = 2/13 and ratio (1 - 2/13) / 4 + 2/13 = 19/52 at s = 4 (clamped to pairs it would be 1/4);
      head_dim 16, L 65536: i(32) = 5.026 -> 5, i(1) = 8.037 -> 9 (> 7, the last pair; <= 15);
      head_dim 8, L 2^27: i(32) = 5.824 -> 5, i(1) = 7.330 -> 8, clamped to 7: every pair (0..3) lies below low,
        kept (ratio 1); clamped to the last pair (3 < low) the ramp would run backwards and interpolate them all."""
    assert yarn_correction_range(64, 10000.0, 65536) == (20, 33)
    assert yarn_correction_range(16, 10000.0, 65536) == (5, 9)
    assert yarn_correction_range(8, 10000.0, 2**27) == (5, 7)
    ratio = rope_frequencies(64, 10000.0, 4.0, 65536, ramp="code") / rope_frequencies(64, 10000.0)
    want = [1.0] * 21 + [(1 - g) / 4 + g for g in (1 - (i - 20) / 13 for i in range(21, 32))]
    torch.testing.assert_close(ratio, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    assert abs(ratio[31].item() - 19 / 52) < 1e-12
    ratio = rope_frequencies(16, 10000.0, 4.0, 65536, ramp="code") / rope_frequencies(16, 10000.0)
    want = [1.0] * 6 + [(1 - g) / 4 + g for g in (1 - (i - 5) / 4 for i in (6, 7))]  # pairs 6, 7: 3/4, 1/2
    torch.testing.assert_close(ratio, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)
    ratio = rope_frequencies(8, 10000.0, 4.0, 2**27, ramp="code") / rope_frequencies(8, 10000.0)
    assert ratio.tolist() == [1.0] * 4
