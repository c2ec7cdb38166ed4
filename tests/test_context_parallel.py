"""Context parallelism (train.py context_parallel_degree, context_parallel.py) on real gloo processes, against one
process on the same batches.

Launches: tests/cp_worker.py on 2 ranks (cp = 2: every encoding, GQA, causal and block_causal, FSDP and DDP, one
layer's attention rows and gradients (the Triton kernel's too, under TRITON_INTERPRET=1), the loss, the activation
memory at cp = 1, 2); tests/fsdp_jobs.py on 2 ranks for train.py itself (FSDP at cp = 2, checkpoints saved at
cp = 2 and resumed in one process, ckpt.pt and dcp). Slow (--runslow): the Triton kernel's training cases and the
32k config's real dimensions on 2 ranks; cp = 4, dp = 2 x cp = 2 and the memory at cp = 4 on 4 ranks. Tiny models
(2 layers x 32 wide), fp32 unless a case says float64.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import old_triton_interpreter

import context_parallel
import sample
import train
from cli import UserError
from model import GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARN = {"rope_scaling": 2.0, "rope_original_block_size": 16}
HEAD16 = {"n_head": 2}  # head_dim 16: the Triton kernel's smallest


def case(kind, pos_encoding, cp=2, dp=1, **kw):
    return {"kind": kind, "dp": dp, "cp": cp, "pos_encoding": pos_encoding, **kw}


BC = {"mask": "block_causal"}
TRAIN2 = {  # cp = 2, dp = 1: name -> case
    "pope": case("train", "pope"),
    "pope-gqa-ddp": case("train", "pope", n_kv_head=2, wrap="ddp"),
    "pope-bc-gqa": case("train", "pope", n_kv_head=2, **BC),
    "pope-bc-positions-not-reset": case("train", "pope", reset=False, **BC),
    "pope-bc-activation-checkpointing": case("train", "pope", checkpoint=True, **BC),
    "rope": case("train", "rope"),
    "rope-bc-gqa": case("train", "rope", n_kv_head=1, **BC),
    "yarn-gqa": case("train", "rope", n_kv_head=2, model=YARN),
    "yarn-bc": case("train", "rope", model=YARN, **BC),
    "alibi-gqa-ddp": case("train", "alibi_half", n_kv_head=2, wrap="ddp"),
    "alibi-bc": case("train", "alibi_half", **BC),
    "none-bc": case("train", "none", **BC),
    "learned-bc": case("train", "learned", **BC),
    "sinusoidal": case("train", "sinusoidal", n_kv_head=2),
    "rope_half-bc": case("train", "rope_half", **BC),
    "pope-bc-float64": case("train", "pope", n_kv_head=2, wrap="ddp", dtype="float64", **BC),
    "rope-float64": case("train", "rope", n_kv_head=2, wrap="ddp", dtype="float64"),
}
F64 = {"dtype": "float64"}
TRITON2 = {  # the Triton kernel under TRITON_INTERPRET=1 (slow: ~8 s a case on 2 loaded cores)
    "pope-triton-gqa": case("train", "pope", n_kv_head=1, backend="triton", model=HEAD16),
    "pope-triton-bc": case("train", "pope", backend="triton", model=HEAD16, **BC),
}
LAYER2 = {  # float64 on the torch path (the Triton kernel: fp32)
    "pope-bc-gqa": case("layer", "pope", n_kv_head=2, **BC, **F64),
    "pope-triton-bc-gqa": case("layer", "pope", n_kv_head=1, backend="triton", model=HEAD16, **BC),
    "pope-triton": case("layer", "pope", backend="triton", model=HEAD16),
    "rope-bc": case("layer", "rope", **BC, **F64),
    "yarn-gqa": case("layer", "rope", n_kv_head=1, model=YARN, **F64),
    "alibi-bc-gqa": case("layer", "alibi_half", n_kv_head=2, **BC, **F64),
    "none-gqa": case("layer", "none", n_kv_head=1, **F64),
}
TRAIN4 = {  # 4 ranks
    "cp4-pope-bc-gqa": case("train", "pope", cp=4, n_kv_head=2, **BC),
    "cp4-rope": case("train", "rope", cp=4),
    "dp2xcp2-pope-bc": case("train", "pope", dp=2, **BC),
    "dp2xcp2-alibi-gqa-ddp": case("train", "alibi_half", dp=2, n_kv_head=2, wrap="ddp"),
}
LAYER4 = {"cp4-pope-bc-gqa": case("layer", "pope", cp=4, n_kv_head=2, **BC, **F64)}
MEMORY = {  # T = 256 tokens, one row: activations saved per rank at cp = 1, 2 (2 ranks) and 4 (4 ranks)
    (enc, cp): case(
        "memory", enc, cp=cp, dp=max(1, 2 // cp) if cp < 4 else 1, T=256, n_kv_head=2 if enc == "rope" else None
    )
    for enc in ("pope", "rope")
    for cp in (1, 2, 4)
}


SHARED = {  # 3 layers: what a forward builds once, not per layer
    "alibi": case("shared", "alibi_half", n_kv_head=2),
    "alibi-positions": case("shared", "alibi_half", mask="block_causal", docs=False),
    "rope-bc": case("shared", "rope", **BC),
    "rope": case("shared", "rope"),
}


def launch(script, n, args, env=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", script, *args]
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:  # a hung rank fails the test and leaves no orphan
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        raise
    assert p.returncode == 0, err[-4000:]
    return out


def run_worker(tmp, n, cases, env=None):
    names = list(cases)
    with open(tmp / "cases.json", "w") as f:
        json.dump([cases[k] for k in names], f)
    launch("tests/cp_worker.py", n, [str(tmp / "cases.json"), str(tmp / "out.json")], env)
    with open(tmp / "out.json") as f:
        results = json.load(f)
    print("seconds per case:", {str(k): round(r["seconds"], 1) for k, r in zip(names, results)})
    return {k: r["result"] for k, r in zip(names, results)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every 2-rank case's result (one launch; the Triton cases in the interpreter, fp32)."""
    cases = {**{("train", k): v for k, v in TRAIN2.items()}, **{("layer", k): v for k, v in LAYER2.items()}}
    cases.update({("memory", k): v for k, v in MEMORY.items() if v["cp"] < 4})
    cases[("loss", "uneven")] = {"kind": "loss", "dp": 1, "cp": 2}
    cases.update({("shared", k): v for k, v in SHARED.items()})
    if old_triton_interpreter():  # its Triton cases would fail the launch, every case with them: left out (None)
        dropped = {k for k, v in cases.items() if v.get("backend") == "triton"}
        kept = run_worker(tmp_path_factory.mktemp("cp2"), 2, {k: v for k, v in cases.items() if k not in dropped})
        return {**kept, **dict.fromkeys(dropped)}
    return run_worker(tmp_path_factory.mktemp("cp2"), 2, cases, {"TRITON_INTERPRET": "1"})


def config_32k():
    """config/finetune_owt_pope_32k_cp.py's settings (a dict)."""
    values = {}
    with open(os.path.join(REPO, "config", "finetune_owt_pope_32k_cp.py")) as f:
        exec(f.read(), {}, values)
    return values


def config_32k_dims():
    c = config_32k()
    return {k: c[k] for k in ("n_layer", "n_head", "n_embd", "pos_encoding")} | {"vocab_size": 50304}


@pytest.fixture(scope="module")
def two_slow(tmp_path_factory):
    """The Triton training cases on 2 ranks (the interpreter, fp32), and the 32k config's model at T = 256 under
    cp = 2 (one launch)."""
    cases = {("train", k): v for k, v in TRITON2.items()}
    cases[("memory", "32k-config")] = case("memory", "pope", T=256, model=config_32k_dims())
    if old_triton_interpreter():  # the launch's Triton cases would fail it for every case
        pytest.skip(old_triton_interpreter())
    return run_worker(tmp_path_factory.mktemp("cp2t"), 2, cases, {"TRITON_INTERPRET": "1"})


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Every 4-rank case's result (one launch)."""
    cases = {
        **{("train", k): v for k, v in TRAIN4.items()},
        **{("layer", k): v for k, v in LAYER4.items()},
        **{("memory", k): v for k, v in MEMORY.items() if v["cp"] == 4},
    }
    return run_worker(tmp_path_factory.mktemp("cp4"), 4, cases)


def check_train(r, name, dtype):
    """Losses of 3 steps: 1e-6 relative (fp32); step 1's gradients: 2e-6 (fp32; the largest element difference over
    the largest element, per tensor); the parameters after 3 AdamW steps: 1e-10 in float64; in fp32 5e-5 as a norm
    (|a - b| / |b| per tensor) and 1e-3 element-wise: AdamW divides each gradient by its own running magnitude, so an
    element whose gradient is near zero carries fp32's summation-order rounding into its update at full size (the
    float64 cases show that the arithmetic itself agrees)."""
    print(
        f"{name}: loss {r['loss_rel']:.1e}, grads {r['grad_rel']:.1e}, params {r['param_rel']:.1e} "
        f"(norm {r['param_rel_l2']:.1e})"
    )
    assert r["loss_rel"] < 1e-6, (name, r)  # GPT.forward's cross-entropy runs in fp32 (logits.float()) either way
    if dtype == "float64":
        assert r["grad_rel"] < 1e-12 and r["param_rel"] < 1e-10, (name, r)
    else:
        assert r["grad_rel"] < 2e-6 and r["param_rel_l2"] < 5e-5 and r["param_rel"] < 1e-3, (name, r)


@pytest.mark.parametrize("name", list(TRAIN2))
def test_cp2_trains_as_one_process(two, name):
    """cp = 2 (FSDP2 over the dp x cp mesh, or DDP): per-step losses, step 1's gradients and the parameters after 3
    AdamW steps equal one process's on the same batches (ignored targets all in cp rank 0's first chunk)."""
    check_train(two[("train", name)], name, TRAIN2[name].get("dtype"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRITON2))
def test_cp2_trains_as_one_process_with_the_triton_kernel(two_slow, name):
    check_train(two_slow[("train", name)], name, None)


@pytest.mark.slow
def test_the_32k_cp_config_runs_with_its_real_dimensions_on_2_ranks(two_slow):
    """config/finetune_owt_pope_32k_cp.py's model (12 x 768, 12 heads, GPT-2's vocabulary) at T = 256 on 2 gloo ranks
    at cp = 2: each rank's logits are (1, 128, 50304), the loss is finite, and the saved activations are within 10 %
    of context_parallel.activation_bytes (fp32 here)."""
    r = two_slow[("memory", "32k-config")]
    print(r)
    assert r["logits"] == [1, 128, 50304] and np.isfinite(r["loss"])
    assert abs(r["measured"] / r["estimate"] - 1) < 0.10, r


def test_the_32k_cp_config_is_one_cp_can_honour_on_8_gpus():
    """Its block_size splits into 2 x cp chunks, cp divides 8 ranks, it runs eagerly under FSDP with activation
    checkpointing, and its global batch (8 rows) divides into dp = 2 groups."""
    c = config_32k()
    context_parallel.check_settings(c["context_parallel_degree"], 8, True, c["block_size"], "nccl", c["compile"])
    assert c["fsdp"] and c["activation_checkpointing"] and c["init_from"] == "finetune"
    assert c["gradient_accumulation_steps"] % (8 // c["context_parallel_degree"]) == 0
    cfg = GPTConfig(**config_32k_dims(), block_size=c["block_size"])
    report = context_parallel.memory_report(cfg, c["batch_size"], c["block_size"], 4, "bfloat16", True)
    print(report)
    assert "each rank keeps 8192 of 32768 tokens per row" in report and "96.00 MiB" in report, report
    assert "with activation checkpointing: ~" in report


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN4))
def test_cp4_and_dp2_by_cp2_train_as_one_process(four, name):
    check_train(four[("train", name)], name, TRAIN4[name].get("dtype"))


@pytest.mark.parametrize(
    "name", [("two", k) for k in LAYER2] + [pytest.param(("four", k), marks=pytest.mark.slow) for k in LAYER4], ids=str
)
def test_one_layers_gathered_attention_equals_the_full_attentions_rows(request, name):
    """A layer's attention (CausalSelfAttention.attend) on this rank's chunks over the gathered keys equals the whole
    sequence's attention at this rank's positions: outputs and the gradients of q, k, v (each key's gradient summed
    from every rank's queries by the all-gather's reduce-scatter), with documents crossing chunk boundaries and
    positions restarting in each; the worst rank."""
    r = request.getfixturevalue(name[0])[("layer", name[1])]
    if r is None:
        pytest.skip(old_triton_interpreter())
    print(name, r)
    f64 = (LAYER2 if name[0] == "two" else LAYER4)[name[1]].get("dtype") == "float64"
    assert max(r.values()) < (1e-12 if f64 else 1e-6), r


def test_the_loss_is_the_global_mean_when_ignored_targets_fall_unevenly(two):
    """Every target of cp rank 0's first chunk ignored: CPBatch.loss gives F.cross_entropy's mean over the whole
    sequence, not the mean of the two ranks' means (which differs here by more than 1e-3)."""
    r = two[("loss", "uneven")]
    assert abs(r["got"] / r["want"] - 1) < 1e-6, r
    assert abs(r["mean_of_rank_means"] - r["want"]) > 1e-3, r


@pytest.mark.parametrize("enc", ["pope", "rope"])
def test_activation_bytes_per_rank_fall_with_cp_as_estimated(two, request, enc):
    """Bytes saved for the backward on the busiest rank (saved_tensors_hooks, storages once, parameters and tables
    left out), T = 256, one row, at cp = 1, 2, 4: within 10 % of context_parallel.activation_bytes, whose per-token
    part falls as 1/cp while the gathered keys and values (and PoPE's torch path's k~ and padded v of each chunk's key
    range) stay the whole sequence's; and they fall with cp."""
    measured = {}
    cps = (1, 2, 4) if request.config.getoption("--runslow") else (1, 2)  # cp = 4 takes the slow 4-rank launch
    for cp in cps:
        r = (two if cp < 4 else request.getfixturevalue("four"))[("memory", (enc, cp))]
        print(f"{enc} cp {cp}: measured {r['measured']:.0f} B, estimate {r['estimate']} B")
        assert abs(r["measured"] / r["estimate"] - 1) < 0.10, (cp, r)
        measured[cp] = r["measured"]
    assert all(measured[b] < measured[a] for a, b in zip(cps, cps[1:]))
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=64, pos_encoding=enc)
    one = context_parallel.activation_bytes(cfg, 1, 256, 1, 4)
    per_token = {cp: context_parallel.activation_bytes(cfg, 1, 256, cp, 4, gathered=False) for cp in (2, 4)}
    assert all(abs(per_token[cp] / (one / cp) - 1) < 0.25 for cp in (2, 4)), (one, per_token)


def test_activation_bytes_counts_the_rotation_rows_only_where_an_encoding_gathers_them():
    """Under CP each rank keeps its tokens' rotation rows once for every layer: the float32 table's columns, head_dim
    for RoPE, head_dim / 2 for rope_half, none for ALiBi or NoPE (counted as RoPE otherwise): known answers from
    the rows' size, n tokens x columns x 4 bytes, at bf16's 2 bytes per element too."""
    n, d = 2 * 256 // 2, 16  # B = 2 rows of T = 256 at cp = 2; head_dim 64 / 4

    def est(enc, e):
        cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=64, pos_encoding=enc)
        return context_parallel.activation_bytes(cfg, 2, 256, 2, e)

    for e in (4, 2):
        assert est("rope", e) - est("none", e) == n * d * 4
        assert est("rope_half", e) - est("none", e) == n * (d // 2) * 4
        assert est("alibi_half", e) == est("none", e)


@pytest.mark.parametrize("name", list(SHARED))
def test_a_cp_forward_builds_alibis_bias_and_ropes_rows_once_for_every_layer(two, name):
    """Under CP, ALiBi's causal float bias (one per query chunk: 2 per forward, however many layers; it was built in
    every layer's every chunk, and saved for the backward by each: about 6 GiB per chunk and layer at 32k, cp 4) and
    RoPE's rotation rows at the rank's global positions (one tensor for q and k of every layer) are shared."""
    r = two[("shared", name)]
    if name.startswith("alibi"):
        assert r["alibi_bias_calls"] == 2, r
    else:
        assert r["rotate_calls"] == 6 and r["distinct_rows"] == 1, r


# --- train.py itself: FSDP and DDP at cp = 2, resume across cp degrees ----------------------------------------------

TINY = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--log_interval=1",
    "--warmup_iters=2",
    "--attn_backend=torch",
    "--compile=False",
    "--device=cpu",
    "--dataset=chars",
    "--block_size=64",
    "--eval_interval=3",
    "--learning_rate=3e-3",
    "--gradient_accumulation_steps=2",
]
POPE_BC = ["--pos_encoding=pope", "--n_kv_head=1", "--attn_mask_type=block_causal"]
CP2 = ["--context_parallel_degree=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders: pope1 one process (6 steps); pope2: cp = 2 under FSDP with activation checkpointing; part2:
    pope2's settings to step 3 at cp = 2, resumed to step 6 in one process (res1); dcp2: the same saved as a dcp
    folder and resumed under FSDP in one process."""
    from conftest import CHAR_TEXT, char_dataset

    tmp = tmp_path_factory.mktemp("cp_train")
    char_dataset(str(tmp / "data" / "chars"), CHAR_TEXT, "chars")
    base = TINY + [f"--data_root={tmp / 'data'}"]
    d = {n: str(tmp / n) for n in ("pope1", "pope2", "part2", "res1", "dcp2")}
    full, part = ["--max_iters=6"], ["--max_iters=3"]
    jobs = [
        {
            "argv": base
            + POPE_BC
            + CP2
            + full
            + ["--fsdp=True", "--activation_checkpointing=True", f"--out_dir={d['pope2']}"]
        },
        {"argv": base + POPE_BC + CP2 + part + ["--fsdp=True", f"--out_dir={d['part2']}"]},
        {"argv": base + POPE_BC + CP2 + part + ["--fsdp=True", "--checkpoint_format=dcp", f"--out_dir={d['dcp2']}"]},
    ]
    with open(tmp / "jobs.json", "w") as f:
        json.dump(jobs, f)
    d["stdout"], d["data_root"] = launch("tests/fsdp_jobs.py", 2, [str(tmp / "jobs.json")]), str(tmp / "data")
    train.main(base + POPE_BC + full + [f"--out_dir={d['pope1']}"])
    shutil.copytree(d["part2"], d["res1"])
    train.main(base + POPE_BC + full + ["--init_from=resume", f"--out_dir={d['res1']}"])
    train.main(base + POPE_BC + full + ["--init_from=resume", "--fsdp=True", f"--out_dir={d['dcp2']}"])  # one process
    return d


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return {r["iter"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


def test_train_py_at_cp2_gives_the_losses_of_one_process(runs, one="pope1", two="pope2"):
    """train.py with context_parallel_degree=2 (PoPE, GQA, block_causal under FSDP with activation checkpointing;
    DDP at cp = 2 is tests/cp_worker.py's wrap='ddp' cases): the logged loss of each of 6 steps, and best.pt's val
    and test losses (a tail window that does not split into 4 chunks runs whole on both ranks, counted once), equal
    one process's within 1e-6."""
    a, b = losses(runs[one]), losses(runs[two])
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[i] for i in a], [a[i] for i in a], rtol=1e-6)
    m1, m2 = metrics(runs[one]), metrics(runs[two])
    for split in ("val", "test"):
        np.testing.assert_allclose(m2[split]["loss"], m1[split]["loss"], rtol=1e-6)
        assert m2[split]["targets"] == m1[split]["targets"]
    assert m2["sharding"]["context_parallel_degree"] == 2 and m2["sharding"]["world_size"] == 2
    w1 = torch.load(os.path.join(runs[one], "best.pt"), weights_only=True)["model"]
    w2 = torch.load(os.path.join(runs[two], "best.pt"), weights_only=True)["model"]  # the one-process layout
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-6)


def test_train_py_prints_the_cp_memory_statement(runs):
    assert "context parallel: cp 2, each rank keeps 32 of 64 tokens per row (chunks of 16, head-tail)" in runs["stdout"]
    assert "activations per rank (estimate, torch attention path)" in runs["stdout"]


@pytest.mark.parametrize("name", ["res1", "dcp2"])
def test_a_run_saved_at_cp2_resumes_in_one_process_and_continues_the_uninterrupted_run(runs, name):
    """Saved at step 3 at cp = 2 under FSDP, as ckpt.pt (res1: resumed without FSDP) or as the sharded ckpt.dcp
    folder (dcp2: resumed under FSDP in one process): steps 4..6 give the one-process run's losses."""
    full, got = losses(runs["pope1"]), losses(runs[name])
    np.testing.assert_allclose([got[i] for i in (4, 5, 6)], [full[i] for i in (4, 5, 6)], rtol=1e-6)


def test_sample_reads_a_cp2_run_unchanged(runs):
    args = ["--start=to be", "--max_new_tokens=5", "--temperature=0", "--device=cpu", "--compile=False"]
    assert sample.main([f"--out_dir={runs['pope2']}", *args]) == sample.main([f"--out_dir={runs['pope1']}", *args])


# --- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,world,backend,message",
    [
        (["--context_parallel_degree=2"], None, None, "splits each sequence across 2 processes: launch with torchrun"),
        (["--context_parallel_degree=2"], 3, "gloo", "context_parallel_degree=2 must divide the 3 processes"),
        (["--context_parallel_degree=4", "--block_size=36"], 4, "gloo", "block_size=36 must be divisible by 2 x"),
        (["--context_parallel_degree=2"], 2, "mpi", "backend 'mpi' is not one of ('gloo', 'nccl')"),
        (["--context_parallel_degree=2", "--compile=True"], 2, "gloo", "runs eagerly: set compile=False"),
        (["--context_parallel_degree=0"], None, None, "context_parallel_degree must be a positive integer"),
    ],
    ids=["single-process", "world", "block_size", "backend", "compile", "zero"],
)
def test_settings_cp_cannot_honour_exit_2_in_one_line(args, world, backend, message, tmp_path, capsys, monkeypatch):
    """Each refusal: exit 2, one line on stderr, before any process group, mesh or file. A world of `world` ranks is
    stood in for by train._processes (the refusals come before the mesh is built)."""
    if world is not None:
        monkeypatch.setattr(train, "_processes", lambda dev: (True, "cpu", 0, 0, world))
        monkeypatch.setattr(train.dist, "get_backend", lambda *a: backend)
    with pytest.raises(SystemExit) as e:
        train.main(
            ["--device=cpu", "--compile=False", "--gradient_accumulation_steps=4", *args, f"--out_dir={tmp_path}/o"]
        )
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.splitlines() == [err] and message in err, err
    assert not os.path.exists(tmp_path / "o")


def test_check_settings_takes_a_resumed_block_size_and_cp_1_always():
    with pytest.raises(UserError, match="block_size=102 must be divisible by 2 x context_parallel_degree = 4"):
        context_parallel.check_settings(2, 2, True, block_size=102)
    context_parallel.check_settings(1, 3, False, block_size=7, backend="mpi", compile=True)  # cp = 1: nothing to check
    context_parallel.check_settings(2, 4, True, block_size=64, backend="nccl")
    assert torch.distributed.is_available()


@pytest.mark.slow
def test_a_run_saved_at_cp2_resumes_at_cp4_and_continues_the_uninterrupted_run(runs, tmp_path):
    """part2 (saved at step 3, cp = 2 under FSDP) resumed on 4 gloo ranks at cp = 4 (chunks of 8 tokens): steps 4..6
    give the one-process run's losses."""
    out = str(tmp_path / "res4")
    shutil.copytree(runs["part2"], out)
    argv = TINY + [f"--data_root={runs['data_root']}"] + POPE_BC + ["--max_iters=6", "--init_from=resume"]
    argv += ["--fsdp=True", "--context_parallel_degree=4", f"--out_dir={out}"]
    with open(tmp_path / "jobs.json", "w") as f:
        json.dump([{"argv": argv}], f)
    launch("tests/fsdp_jobs.py", 4, [str(tmp_path / "jobs.json")])
    full, got = losses(runs["pope1"]), losses(out)
    np.testing.assert_allclose([got[i] for i in (4, 5, 6)], [full[i] for i in (4, 5, 6)], rtol=1e-6)
    assert metrics(out)["sharding"]["context_parallel_degree"] == 4


@pytest.mark.parametrize("groups", [1, 2])
def test_lower_right_attention_equals_the_masked_chunk_without_a_mask(groups):
    """pope.lower_right_attention (what sdpa_attention runs on CUDA for a chunk at q_offset = Tk - Tq, a CP rank's
    query chunk: no chunk x end mask tensor) equals SDPA with pope.causal_mask, forward and gradients, with grouped
    heads (float64; on the CPU, SDPA materialises the bias itself)."""
    import torch.nn.functional as F

    from pope import causal_mask, lower_right_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 4 // groups, 24, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(8, 24, 16), enable_gqa=groups > 1)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    got_y = lower_right_attention(q, k, v)
    got = torch.autograd.grad((got_y * w).sum(), (q, k, v))
    torch.testing.assert_close(got_y, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
