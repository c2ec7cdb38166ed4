"""Issue 60's search rules as docs/runs/i60-search-report.py applies them (docs/extrapolation.md, "The search
(issue 60)"), on hand-made grids whose decisions are worked out here: YaRN's 960-step trigger and its shortest
length within 0.01 nats of the best, the `code` secondary of a `paper` choice; DroPE's recovery within 0.05 nats
of its parent (shortest length, then the lower lr) or none; PoPE's (and RoPE's) default lr unless another is 0.01
lower; and the report read from records on disk (both seeds needed before a setting counts)."""

import importlib.util
import itertools
import json
import os
import subprocess
import sys

import pytest

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "runs", "i60-search-report.py")
spec = importlib.util.spec_from_file_location("i60_search_report", PATH)
rep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rep)


def yarn_grid(v240=1.62, v60=1.625, v15=1.66, v960=None):
    """12 settings (15-240 x lr x ramp); `code` at lr 3e-4 is the length's best, the others above it."""
    v = {}
    for (n, base), lr, ramp in itertools.product(((15, v15), (60, v60), (240, v240)), (1e-4, 3e-4), ("code", "paper")):
        v[(n, lr, ramp)] = base + (0.003 if lr == 1e-4 else 0) + (0.002 if ramp == "paper" else 0)
    if v960 is not None:
        v.update(
            {(960, lr, ramp): v960 + (0.003 if lr == 1e-4 else 0) for lr in (1e-4, 3e-4) for ramp in ("code", "paper")}
        )
    return v


def test_yarn_without_the_960_row_takes_the_shortest_length_within_the_tolerance():
    # 240 is 0.005 below 60 (< 0.01: no 960 row); best 1.620, 60's code 3e-4 at 1.625 is within 0.01 -> 60 steps
    d = rep.choose_yarn(yarn_grid(v240=1.620, v60=1.625))
    assert d["status"] == "decided" and not d["need_960"] and d["choice"] == (60, 3e-4, "code")
    # 15 steps within 0.01 of the best: 15 (without the 960 row the choice is never 240: 60 is within 0.01 of it)
    d = rep.choose_yarn(yarn_grid(v240=1.620, v60=1.625, v15=1.628))
    assert d["choice"] == (15, 3e-4, "code") and d["best"] == pytest.approx(1.620)


def test_yarn_960_row_is_called_for_when_240_gains_more_than_the_tolerance():
    for v240 in (1.600, 1.6135):  # 0.025 and 0.0115 gained from 60 to 240
        v = yarn_grid(v240=v240, v60=1.625)
        assert rep.choose_yarn(v) == {"status": "pending: the 960 row is called for and not complete", "need_960": True}
    d = rep.choose_yarn(yarn_grid(v240=1.600, v60=1.625, v960=1.595))  # 960 best, 240 within 0.005: 240 chosen
    assert d["need_960"] and d["choice"] == (240, 3e-4, "code") and d["best"] == pytest.approx(1.595)
    d = rep.choose_yarn(yarn_grid(v240=1.600, v60=1.625, v960=1.580))  # 960 0.02 better: 960 chosen
    assert d["choice"] == (960, 3e-4, "code")


def test_yarn_paper_choice_names_the_best_code_setting_of_its_length():
    v = yarn_grid(v240=1.620, v60=1.700, v960=1.650)
    v[(240, 1e-4, "paper")] = 1.605  # the paper ramp at lr 1e-4 is the best of all, the only one within 0.01
    d = rep.choose_yarn(v)
    assert d["choice"] == (240, 1e-4, "paper") and d["secondary"] == (240, 3e-4, "code")


def test_yarn_waits_for_the_whole_grid():
    v = yarn_grid()
    del v[(15, 1e-4, "code")]
    assert rep.choose_yarn(v)["status"].startswith("pending")


def test_drope_recovery_and_its_absence():
    gap = {(n, lr): 0.9 for n in (60, 240, 1500) for lr in (3e-4, 1e-3)}
    assert rep.choose_drope(gap) == {"status": "decided", "recovered": False}
    gap[(1500, 3e-4)], gap[(1500, 1e-3)], gap[(240, 1e-3)] = 0.04, 0.01, 0.049
    assert rep.choose_drope(gap) == {"status": "decided", "recovered": True, "choice": (240, 1e-3)}
    gap[(240, 3e-4)] = 0.05  # on the tolerance: recovered, and the lower lr of the shortest length
    assert rep.choose_drope(gap)["choice"] == (240, 3e-4)
    del gap[(60, 3e-4)]
    assert rep.choose_drope(gap)["status"].startswith("pending")


def test_pope_keeps_its_default_lr_unless_another_is_lower_by_more_than_the_tolerance():
    assert rep.choose_pope({5e-4: 1.60, 1e-3: 1.605, 2e-3: 1.62})["choice"] == 1e-3  # 0.005: default
    assert rep.choose_pope({5e-4: 1.60, 1e-3: 1.615, 2e-3: 1.59})["choice"] == 2e-3  # 0.025: the lowest
    assert rep.choose_pope({5e-4: 1.60, 1e-3: 1.605})["status"].startswith("pending")


def test_the_report_reads_records_and_counts_a_setting_only_with_both_seeds(tmp_path):
    def rec(name, val, **cfg):
        with open(tmp_path / f"{name}.json", "w") as f:
            json.dump({"config": cfg, "val": {"loss": val}, "test": {"loss": 0.0}}, f)
        with open(tmp_path / f"{name}.log.jsonl", "w") as f:
            f.write(
                f'{{"iter": 0, "val_loss": 2.0}}\n{{"iter": 5, "loss": 1.9}}\n{{"iter": 10, "val_loss": {val!r}}}\n'
            )

    for s, parent in ((6001, 1.62), (6002, 1.63)):
        rec(f"i60s-rope-s{s}", parent, seed=s, learning_rate=1e-3)
        rec(f"i60s-rope-lr2e-3-s{s}", parent - 0.02, seed=s, learning_rate=2e-3)  # the amendment: not DroPE's parent
        for lr in (5e-4, 1e-3, 2e-3):
            rec(f"i60s-pope-lr{lr}-s{s}", 1.60 + (0.03 if lr == 2e-3 else 0), seed=s, learning_rate=lr)
        for n, lr in itertools.product((60, 240, 1500), (3e-4, 1e-3)):
            rec(
                f"i60s-drope-n{n}-lr{lr}-s{s}",
                parent + (0.04 if (n, lr) == (1500, 1e-3) else 0.5),
                seed=s,
                max_iters=n,
                learning_rate=lr,
            )
    rec("i60s-yarn-n15-lr1e-4-code-s6001", 1.7, seed=6001, max_iters=15, learning_rate=1e-4, rope_yarn_ramp="code")
    out = subprocess.run(
        [sys.executable, PATH, f"--runs={tmp_path}"], capture_output=True, text=True, check=True
    ).stdout
    assert "| 15 steps, lr 0.0001, code | 1.7000 | pending | — | -0.3000 / — |" in out
    assert "- YaRN: {'status': 'pending: the 15-240 grid is not complete'}" in out
    assert "- DroPE: {'status': 'decided', 'recovered': True, 'choice': (1500, 0.001)}" in out
    assert "- PoPE: {'status': 'decided', 'choice': 0.001}" in out
    assert "(1500, 0.001): +0.0400" in out  # against the lr-1e-3 parent only
    assert "| lr 0.002 | 1.6000 | 1.6100 | 1.6050 |" in out  # RoPE's lr table
    assert "| lr 0.001 | 1.6000 | 1.6000 | 1.6000 | -0.4000 / -0.4000 |" in out  # PoPE's own curves, not RoPE's
    assert "| lr 0.001 | 1.6200 | 1.6300 | 1.6250 | -0.3800 / -0.3700 |" in out
    assert "- RoPE (the amendment): {'status': 'pending: the RoPE lr grid is not complete'}" in out
