"""FSDP2 (train.py fsdp=True), activation checkpointing and checkpoints across set-ups, with real gloo processes.

One torchrun launch of 2 processes runs every 2-rank job (tests/fsdp_jobs.py); the 1-process runs they are
compared with run in this process. Tiny models (2 layers x 32 wide), 10 steps, fp32, no dropout.
"""

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import sample
import sharding
import train
from model import GPT, POS_ENCODINGS, GPTConfig
from prepare.common import document_offsets, write_documents

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    "--device=cpu",  # gloo ranks on the CPU, also on a GPU machine (2 ranks on 1 GPU exit 2; review of the H200 run)
    "--dataset=chars",
    "--block_size=64",
    "--eval_interval=5",
    "--lr_decay_iters=10",
    "--learning_rate=3e-3",  # val loss falls below its step-0 value: best.pt is written
    "--gradient_accumulation_steps=4",  # 2 micro-steps per rank on 2 ranks: the first must not reduce
]
CASES = {
    "rope": ["--pos_encoding=rope"],
    # GQA and activation checkpointing on the sharded run (the 1-process reference runs without it)
    "pope": ["--pos_encoding=pope", "--n_kv_head=1"],
}
FSDP = ["--fsdp=True"]
AC = ["--activation_checkpointing=True"]


def losses(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return {r["iter"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def small_chars(tmp_path_factory):
    """A stream dataset of 1,760 tokens (conftest.char_dataset's characters) whose tokenizer has no text codec
    (kind 'none': prompts are ids, and train.py samples no text at the end of each run): short final evaluations,
    whose batches the two ranks share unevenly (rank 0 also takes the tail window)."""
    from conftest import CHAR_TEXT, char_dataset

    root = tmp_path_factory.mktemp("data")
    char_dataset(str(root / "chars"), CHAR_TEXT, "chars")
    with open(root / "chars" / "meta.json") as f:
        meta = json.load(f)
    # documents of 1 to 150 tokens for block_causal (the other runs ignore them)
    docs = {}
    for split, info in meta["splits"].items():
        lengths, n = [], info["tokens"]
        while sum(lengths) < n:
            lengths.append(min((5, 1, 40, 7, 150, 3, 60)[len(lengths) % 7], n - sum(lengths)))
        docs[split] = document_offsets(lengths)
    meta["documents"] = write_documents(str(root / "chars"), docs)
    with open(root / "chars" / "meta.json", "w") as f:
        json.dump({**meta, "tokenizer": {"kind": "none"}}, f)
    return str(root)


@pytest.fixture(scope="module")
def runs(small_chars, tmp_path_factory):
    """Every run folder, by name: <case>1 one process without FSDP, <case>2 FSDP on 2 ranks (pope2 with
    activation checkpointing); resumes of pope2's settings saved at step 5 (part2: FSDP on 2 ranks; part1: one
    process): res_fsdp2, res_ddp2 (FSDP -> DDP), res_1 (FSDP -> one process), res_fsdp1 (FSDP -> FSDP in one
    process), res_from1 (one process -> FSDP on 2 ranks); dcp2: pope2 with checkpoint_format='dcp' resumed from
    its ckpt.dcp at step 5 (without repeating --checkpoint_format=dcp)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    d = {name: str(tmp / name) for name in ("rope1", "rope2", "pope1", "pope2", "part1", "part2", "dcp2", "bc1", "bc2")}
    for name in ("res_fsdp2", "res_ddp2", "res_1", "res_fsdp1", "res_from1", "last2"):
        d[name] = str(tmp / name)
    base = TINY + [f"--data_root={small_chars}"]
    full, part = ["--max_iters=10"], ["--max_iters=5"]
    for case, extra in CASES.items():  # the 1-process references
        train.main(base + extra + full + [f"--out_dir={d[case + '1']}"])
    train.main(base + CASES["pope"] + part + [f"--out_dir={d['part1']}"])
    block_causal = base + CASES["pope"] + ["--attn_mask_type=block_causal"] + full
    train.main(block_causal + [f"--out_dir={d['bc1']}"])
    pope2 = base + CASES["pope"] + FSDP + AC
    resume = ["--init_from=resume"] + full
    jobs = [
        {"argv": base + CASES["rope"] + FSDP + full + [f"--out_dir={d['rope2']}"]},
        {
            "argv": base
            + CASES["rope"]
            + FSDP
            + full
            + ["--fsdp_reduce_every_micro_step=False", f"--out_dir={d['last2']}"]
        },
        {"argv": pope2 + full + [f"--out_dir={d['pope2']}"]},
        {"argv": pope2 + part + [f"--out_dir={d['part2']}"]},
        {"copy": [d["part2"], d["res_fsdp2"]]},
        {"copy": [d["part2"], d["res_ddp2"]]},
        {"copy": [d["part1"], d["res_from1"]]},
        {"argv": pope2 + resume + [f"--out_dir={d['res_fsdp2']}"]},
        {"argv": base + CASES["pope"] + resume + [f"--out_dir={d['res_ddp2']}"]},
        {"argv": pope2 + resume + [f"--out_dir={d['res_from1']}"]},
        {"argv": pope2 + part + ["--checkpoint_format=dcp", f"--out_dir={d['dcp2']}"]},
        {"argv": pope2 + resume + [f"--out_dir={d['dcp2']}"]},  # without --checkpoint_format=dcp: finds ckpt.dcp
        {"argv": block_causal + FSDP + [f"--out_dir={d['bc2']}"]},
    ]
    with open(tmp / "jobs.json", "w") as f:
        json.dump(jobs, f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p = subprocess.Popen(
        [*cmd, "tests/fsdp_jobs.py", str(tmp / "jobs.json")],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:  # a hung rank fails the test and leaves no orphan
        out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        raise
    assert p.returncode == 0, err[-4000:]
    shutil.copytree(d["part2"], d["res_1"])
    shutil.copytree(d["part2"], d["res_fsdp1"])
    train.main(base + CASES["pope"] + resume + [f"--out_dir={d['res_1']}"])
    train.main(base + CASES["pope"] + FSDP + resume + [f"--out_dir={d['res_fsdp1']}"])  # a group of one process
    d["stdout"], d["data_root"] = out, small_chars
    return d


def assert_same_losses(a, b, steps):
    assert sorted(a) == sorted(b) == list(steps)
    print(f"steps {steps[0]}..{steps[-1]}: max relative loss difference {max(abs(b[i] / a[i] - 1) for i in steps):.1e}")
    np.testing.assert_allclose([b[i] for i in steps], [a[i] for i in steps], rtol=1e-5, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_on_two_ranks_gives_the_losses_of_one_process(runs, case):
    """Same global batch (4 micro-batches of 4: 2 per rank, reduced on the second only): the loss at each of
    10 steps equals the one-process run's within 1e-5 (fp32); so do the val and test losses of best.pt, and
    best.pt's weights, gathered from both ranks' shards. pope2 runs with GQA and activation checkpointing."""
    one, two = runs[case + "1"], runs[case + "2"]
    assert_same_losses(losses(one), losses(two), range(1, 11))
    m1, m2 = metrics(one), metrics(two)
    for split in ("val", "test"):
        np.testing.assert_allclose(m2[split]["loss"], m1[split]["loss"], rtol=1e-5)
    assert m2["sharding"]["fsdp"] and m2["sharding"]["world_size"] == 2
    assert m2["sharding"]["mixed_precision"] == {"param_dtype": "float32", "reduce_dtype": "float32"}
    assert m2["sharding"]["activation_checkpointing"] == (case == "pope")
    w1 = torch.load(os.path.join(one, "best.pt"), weights_only=True)["model"]
    w2 = torch.load(os.path.join(two, "best.pt"), weights_only=True)["model"]
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-4, atol=1e-6)
    delta = [v for k, v in w2.items() if k.endswith("pope_delta")]
    assert all(float(v.max()) <= 0.0 and float(v.min()) >= -2 * np.pi for v in delta)


def test_fsdp_with_block_causal_gives_the_losses_of_one_process(runs):
    """Packed documents (issue 58) under FSDP on 2 ranks: the losses of one process with the same mask, which
    differ from the causal run's (the mask matters on these documents of 1 to 150 tokens)."""
    one, two = losses(runs["bc1"]), losses(runs["bc2"])
    assert_same_losses(one, two, range(1, 11))
    assert metrics(runs["bc2"])["config"]["attn_mask_type"] == "block_causal"
    assert abs(one[10] - losses(runs["pope1"])[10]) > 1e-3


@pytest.mark.parametrize(
    "name", ["res_fsdp2", "res_ddp2", "res_1", "res_fsdp1", "res_from1", "dcp2"], ids=lambda n: n.removeprefix("res_")
)
def test_a_resume_on_any_set_up_continues_the_uninterrupted_run(runs, name):
    """Saved at step 5 (FSDP on 2 ranks, or one process for res_from1), resumed to step 10 under FSDP on 2 ranks,
    under DDP, in one process, under FSDP in one process, from one process to FSDP, and from a dcp folder: steps
    6..10 give the uninterrupted run's losses (within 1e-5), and so does the optimizer state (AdamW's moments
    carry over: a fresh optimizer would not)."""
    full = losses(runs["pope1"])
    got = losses(runs[name])
    assert_same_losses({i: full[i] for i in range(6, 11)}, {i: got[i] for i in range(6, 11)}, range(6, 11))
    if name == "dcp2":  # resumed without repeating --checkpoint_format=dcp: it found ckpt.dcp and said so
        folder = os.path.join(runs["dcp2"], "ckpt.dcp")
        assert f"resuming from {folder}, with checkpoint_format='dcp'" in runs["stdout"]
        assert metrics(runs["dcp2"])["config"]["checkpoint_format"] == "dcp"
    ckpt = torch.load(os.path.join(runs[name if name != "dcp2" else "pope1"], "ckpt.pt"), weights_only=True)
    assert ckpt["iter_num"] == 10 and set(ckpt["optimizer"]["state"]) == set(range(len(ckpt["optimizer"]["state"])))


def test_an_elastic_restart_resumes_from_the_checkpoint_instead_of_starting_over(runs, tmp_path, monkeypatch, capsys):
    """torchrun --max-restarts runs the same command again with TORCHELASTIC_RESTART_COUNT=1: a run started with
    init_from='scratch' that finds its ckpt.pt (step 5) resumes from it, and steps 6..10 are the uninterrupted
    run's. (The first start, TORCHELASTIC_RESTART_COUNT=0, trains from scratch: every other test.)"""
    out = str(tmp_path / "restarted")
    shutil.copytree(runs["part1"], out)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    m = train.main(TINY + CASES["pope"] + [f"--data_root={runs['data_root']}", "--max_iters=10", f"--out_dir={out}"])
    assert f"elastic restart 1 (torchrun --max-restarts): resuming from {out}" in capsys.readouterr().out
    full, got = losses(runs["pope1"]), losses(out)
    assert_same_losses({i: full[i] for i in range(6, 11)}, {i: got[i] for i in range(6, 11)}, range(6, 11))
    assert m["config"]["init_from"] == "resume" and len(m["provenance_earlier"]) == 1


def test_the_gathered_checkpoint_has_the_layout_of_a_one_process_run(runs):
    """ckpt.pt of FSDP on 2 ranks: the keys, shapes and optimizer layout (by index, the same groups) of a
    one-process run's, every tensor whole."""
    a = torch.load(os.path.join(runs["pope1"], "ckpt.pt"), weights_only=True)
    b = torch.load(os.path.join(runs["pope2"], "ckpt.pt"), weights_only=True)
    assert {k: v.shape for k, v in a["model"].items()} == {k: v.shape for k, v in b["model"].items()}
    assert [g["params"] for g in a["optimizer"]["param_groups"]] == [
        g["params"] for g in b["optimizer"]["param_groups"]
    ]
    for i, s in a["optimizer"]["state"].items():
        assert {k: v.shape for k, v in s.items()} == {k: v.shape for k, v in b["optimizer"]["state"][i].items()}
        torch.testing.assert_close(b["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], rtol=1e-3, atol=1e-7)


def test_sample_and_eval_extrapolate_read_the_fsdp_run_folder(runs, small_chars, tmp_path):
    """sample.py and eval_extrapolate.py read the FSDP run's best.pt unchanged: the same greedy tokens and the
    same losses as from the one-process run's (the weights are equal within 1e-5)."""
    import eval_extrapolate

    args = ["--start=[1, 2, 3]", "--max_new_tokens=5", "--temperature=0", "--device=cpu", "--compile=False"]
    assert sample.main([f"--out_dir={runs['pope2']}", *args]) == sample.main([f"--out_dir={runs['pope1']}", *args])
    common = [f"--data_root={small_chars}", "--dataset=chars", "--lengths=64,128", "--last_k=32"]
    ppl = {}
    for name in ("pope1", "pope2"):
        eval_extrapolate.main([runs[name], *common, "--device=cpu", f"--out_dir={tmp_path / name}"])
        with open(tmp_path / name / "extrapolation.csv") as f:
            ppl[name] = [float(r["ppl"]) for r in csv.DictReader(f)]
    assert len(ppl["pope2"]) == 2
    np.testing.assert_allclose(ppl["pope2"], ppl["pope1"], rtol=1e-4)


def test_bytes_per_rank_at_world_2_are_half_of_world_1(runs):
    """Parameters, gradients and AdamW state this rank held after step 1, measured from its local shards
    (metrics.json): at world 2 half of world 1's, plus at most one row of each tensor (dim-0 shards of an odd
    number of rows); and the estimate from the model's shapes equals the measurement at both world sizes."""
    model_args = torch.load(os.path.join(runs["rope1"], "ckpt.pt"), weights_only=True)["model_args"]
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    row = sum(4 * p.numel() // p.shape[0] for p in model.parameters())  # one fp32 row of every tensor
    m1 = metrics(runs["rope1"])["sharding"]["memory_per_rank"]
    m2 = metrics(runs["rope2"])["sharding"]["memory_per_rank"]
    for key, rows in (("params", 1), ("grads", 1), ("optimizer", 2)):
        w1, w2 = m1["measured"][key], m2["measured"][key]
        fixed = 4 * len(list(model.parameters())) if key == "optimizer" else 0  # AdamW's 0-d step per tensor
        assert (w1 - fixed) / 2 <= w2 - fixed <= (w1 - fixed) / 2 + rows * row, (key, w1, w2)
        assert m1["estimate"][key] == w1 and m2["estimate"][key] == w2
    assert m1["measured"]["params"] == 4 * sum(p.numel() for p in model.parameters())


def test_fsdp_gradients_stay_sharded_through_the_micro_steps_unless_reduced_on_the_last_only(runs):
    """2 ranks x 2 micro-steps (issue 69): with fsdp_reduce_every_micro_step=True (the default) a rank's gradients
    peak inside the step at its shard, half of the whole plus at most one row of each tensor; with False FSDP2
    keeps whole fp32 gradients until the last micro-step: 4 bytes per parameter on every rank. Measured after each
    micro-step's backward of step 1 (metrics.json); the estimate equals the measurement for both; the losses of
    both are the one-process run's; train.py prints both choices' bytes and reduce-scatters."""
    model_args = torch.load(os.path.join(runs["rope1"], "ckpt.pt"), weights_only=True)["model_args"]
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    whole = 4 * sum(p.numel() for p in model.parameters())
    row = sum(4 * p.numel() // p.shape[0] for p in model.parameters())
    every = metrics(runs["rope2"])["sharding"]
    last = metrics(runs["last2"])["sharding"]
    assert every["fsdp_reduce_every_micro_step"] and not last["fsdp_reduce_every_micro_step"]
    assert last["memory_per_rank"]["measured"]["grads"] == last["memory_per_rank"]["estimate"]["grads"] == whole
    got = every["memory_per_rank"]["measured"]["grads"]
    assert got == every["memory_per_rank"]["estimate"]["grads"] and whole / 2 <= got <= whole / 2 + row, (got, whole)
    assert_same_losses(losses(runs["rope1"]), losses(runs["last2"]), range(1, 11))
    groups = model_args["n_layer"] + 1
    assert (
        f"True, this run: reduce-scatter after every micro-step: grads {sharding.gib(got)}, {2 * groups} reduce"
        in (runs["stdout"])
    )
    assert (
        f"False: on the last micro-step only (whole fp32 grads): grads {sharding.gib(whole)}, {groups} reduce"
        in (runs["stdout"])
    )


def test_a_dcp_folder_given_to_sample_says_how_to_convert_it_and_the_conversion_samples(runs, tmp_path, capsys):
    """checkpoint_format='dcp' writes best.dcp and ckpt.dcp, no .pt: sample.py exits 2 with the one-line command
    that converts them; that command writes a best.pt sample.py reads, whose weights are the run's."""
    folder = runs["dcp2"]
    assert sorted(n for n in os.listdir(folder) if n.endswith((".pt", ".dcp"))) == ["best.dcp", "ckpt.dcp"]
    args = ["--start=[1, 2, 3]", "--max_new_tokens=5", "--temperature=0", "--device=cpu", "--compile=False"]
    with pytest.raises(SystemExit) as e:
        sample.main([f"--out_dir={folder}", *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "python sharding.py" in err, err
    cmd = err.split("convert it to one file first: ")[1].split()
    assert cmd[:2] == ["python", "sharding.py"]
    sharding.main(cmd[2:])
    assert sample.main([f"--out_dir={folder}", *args]) == sample.main([f"--out_dir={runs['pope2']}", *args])
    sharding.main([os.path.join(folder, "ckpt.dcp"), str(tmp_path / "ckpt.pt")])
    a = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    b = torch.load(os.path.join(runs["pope2"], "ckpt.pt"), weights_only=True)
    assert a["iter_num"] == b["iter_num"] == 10 and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for k in b["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fsdp=True", "--dtype=float16"], "fsdp=True trains in bfloat16 or float32, not float16"),
        (["--checkpoint_format=dcp"], "checkpoint_format='dcp' writes an FSDP run's shards"),
        (["--fsdp=True", "--checkpoint_format=zip"], "checkpoint_format must be 'single' or 'dcp'"),
    ],
)
def test_settings_fsdp_cannot_honour_exit_2_in_one_line_and_touch_nothing(args, message, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"earlier run")
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, f"--out_dir={out}", "--init_from=resume", *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.splitlines() == [err] and message in err, err
    assert sorted(os.listdir(out)) == ["ckpt.pt"] and (out / "ckpt.pt").read_bytes() == b"earlier run"


@pytest.mark.slow
def test_a_compiled_fsdp_step_with_activation_checkpointing_on_the_triton_path(tmp_path):
    """train.py with the GPU's defaults (--compile=True --attn_backend=triton: Inductor, PoPE's custom ops and
    its selective checkpoint, the Triton kernels in the interpreter) under FSDP with activation checkpointing on
    two gloo processes: the losses of 4 steps and the final val/test losses equal one process's without either
    (compiled too), within 1e-5. Slow: three processes compile."""
    from test_compiled_gpu_path import _tiny_stream

    data_root = _tiny_stream(str(tmp_path))
    args = [
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--batch_size=2",
        "--gradient_accumulation_steps=4",
        "--block_size=16",
        "--eval_iters=1",
        "--eval_interval=2",
        "--log_interval=1",
        "--warmup_iters=1",
        "--device=cpu",
        "--compile=True",
        "--attn_backend=triton",
        "--dataset=toy",
        f"--data_root={data_root}",
        "--pope_delta_init=uniform",
        "--max_iters=4",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    out = {}
    for name, launch, extra in (
        ("one", [], []),
        ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], FSDP + AC),
    ):
        p = subprocess.run(
            [sys.executable, *launch, "train.py", *args, *extra, f"--out_dir={tmp_path / name}"],
            cwd=REPO,
            env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{name}")},
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = losses(tmp_path / name), metrics(tmp_path / name)
    (one, m1), (two, m2) = out["one"], out["two"]
    assert_same_losses(one, two, range(1, 5))
    assert m2["sharding"]["fsdp"] and m2["sharding"]["activation_checkpointing"]
    for split in ("val", "test"):
        np.testing.assert_allclose(m2[split]["loss"], m1[split]["loss"], rtol=1e-5)


def test_activation_checkpointing_keeps_only_each_blocks_input_and_the_same_gradients():
    """checkpoint_blocks: the tensors autograd saves in the forward (saved_tensors_hooks, bytes) shrink to the
    blocks' inputs and what lies outside the blocks; the recomputed backward gives the same loss and gradients;
    without gradients (evaluation, decoding) the blocks run plainly."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=32, attn_backend="torch")
    x = torch.randint(0, 64, (2, 32))

    def step(model):
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, x)[1]
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}, sum(saved)

    plain = GPT(cfg)
    ckpt = GPT(cfg)
    ckpt.load_state_dict(plain.state_dict())
    sharding.checkpoint_blocks(ckpt)
    loss_a, grads_a, bytes_a = step(plain)
    loss_b, grads_b, bytes_b = step(ckpt)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    for n in grads_a:
        torch.testing.assert_close(grads_b[n], grads_a[n], rtol=1e-6, atol=1e-8)
    block_input = 2 * 32 * 32 * 4  # (B, T, n_embd) fp32: what a checkpointed Block keeps
    print(f"saved for the backward: {bytes_a} bytes, {bytes_b} with activation checkpointing")
    assert bytes_a - bytes_b > cfg.n_layer * 8 * block_input, (bytes_a, bytes_b)  # each Block kept > 9 inputs' worth
    with torch.no_grad():
        torch.testing.assert_close(ckpt(x)[0], plain(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("every", [False, True])
def test_a_non_final_micro_step_reduces_only_if_asked_and_the_last_reduces_both(every):
    """train.set_grad_sync under FSDP (a process group of one, gloo). fsdp_reduce_every_micro_step=False: after a
    non-final micro-step no sharded gradient exists yet (no reduce-scatter ran) and FSDP holds the whole ones
    (sharding.grad_bytes: 4 bytes per parameter); True: the first micro-step's sharded gradients exist already.
    Either way, after the last micro-step every sharded gradient is the sum of both micro-steps', as a plain
    model's two backward passes give."""
    from types import SimpleNamespace

    import torch.distributed as dist

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, attn_backend="torch")
    plain, sharded = GPT(cfg), GPT(cfg)
    sharded.load_state_dict(plain.state_dict())
    xs = [torch.randint(0, 64, (2, 16)) for _ in range(2)]
    for x in xs:
        plain(x, x)[1].backward()
    whole = 4 * sum(p.numel() for p in plain.parameters())
    sharding.init_single_process("cpu")
    try:
        sharding.shard(sharded, "cpu", "float32")
        run = SimpleNamespace(fsdp=True, ddp=True, fsdp_reduce_every_micro_step=every)
        train.set_grad_sync(sharded, sharded, run, False)
        sharded(xs[0], xs[0])[1].backward()
        assert all((p.grad is not None) == every for p in sharded.parameters())
        assert sharding.grad_bytes(sharded) == whole  # world 1: a shard is the whole tensor, held once either way
        train.set_grad_sync(sharded, sharded, run, True)
        sharded(xs[1], xs[1])[1].backward()
        want = dict(plain.named_parameters())
        for name, p in sharded.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), want[name].grad, rtol=1e-5, atol=1e-7)
        assert sharding.grad_bytes(sharded) == whole
    finally:
        dist.destroy_process_group()


def test_a_run_that_leaves_the_reduce_choice_unset_reduce_scatters_after_every_micro_step(
    small_chars, tmp_path, monkeypatch, capsys
):
    """fsdp_reduce_every_micro_step's default is True (docs/usage.md, "True (the default"): a real FSDP run in one
    process that does not set it, 2 steps of 2 micro-steps, asks FSDP to reduce-scatter in every micro-step's backward
    (set_requires_gradient_sync(True) four times; False, the other choice, would first ask False), records True in
    metrics.json (its config and "sharding") and prints itself as that choice."""
    from torch.distributed.fsdp import FSDPModule

    asked, real = [], FSDPModule.set_requires_gradient_sync

    def spy(self, sync, **kw):
        asked.append(sync)
        return real(self, sync, **kw)

    monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync", spy)
    args = [*TINY, f"--data_root={small_chars}", *FSDP, *CASES["rope"], "--gradient_accumulation_steps=2"]
    m = train.main([*args, "--max_iters=2", "--eval_interval=2", "--eval_iters=1", f"--out_dir={tmp_path}"])
    assert asked == [True, True, True, True]
    assert m["config"]["fsdp_reduce_every_micro_step"] is True and m["sharding"]["fsdp_reduce_every_micro_step"] is True
    assert "    True, this run: reduce-scatter after every micro-step" in capsys.readouterr().out
    with open(os.path.join(REPO, "docs", "usage.md")) as f:
        assert (
            "**`fsdp_reduce_every_micro_step`** (with `fsdp=True` and several micro-steps per rank): `True` (the"
            in (" ".join(f.read().split()))
        )


@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_every_encoding_trains_under_fsdp_as_without_it(pos_encoding):
    """Three AdamW steps (clipping, δ's projection) of a GPT with grouped-query attention, sharded by FSDP in a
    process group of one, equal the same steps of the plain GPT: losses and final weights (fp32). The non-
    persistent tables (rotations, sinusoids, ALiBi slopes) stay plain buffers."""
    import torch.distributed as dist

    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=32,
        vocab_size=64,
        block_size=16,
        attn_backend="torch",
        pos_encoding=pos_encoding,
        pope_delta_init="uniform",
    )
    plain, sharded = GPT(cfg), GPT(cfg)
    sharded.load_state_dict(plain.state_dict())
    xs = [torch.randint(0, 64, (2, 16)) for _ in range(3)]

    def train_steps(model):
        opt = model.configure_optimizers(0.1, 3e-2, (0.9, 0.95), "cpu")
        out = []
        for x in xs:
            loss = model(x, x)[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            model.clamp_pope_delta_()
            out.append(loss.item())
        return out

    want = train_steps(plain)
    sharding.init_single_process("cpu")
    try:
        sharding.shard(sharded, "cpu", "float32")
        assert all(not hasattr(b, "to_local") for b in sharded.buffers())
        got = train_steps(sharded)
        weights = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    finally:
        dist.destroy_process_group()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pos_encoding", ["rope", "pope"])
def test_bf16_fsdp_hands_every_block_the_float32_rotation_table(pos_encoding):
    """FSDP's bf16 policy casts a Block's floating inputs by default, GPT.rotation with them (cos/sin to 8 bits);
    sharding.shard turns that off: every Block receives the float32 table (a review found it; fp32 runs cannot)."""
    import torch.distributed as dist

    sharding.init_single_process("cpu")
    try:
        torch.manual_seed(0)
        m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, pos_encoding=pos_encoding))
        sharding.shard(m, "cpu", "bfloat16")
        seen = []
        for block in m.transformer.h:  # after FSDP's own pre-hook: what the Block's forward gets
            block.register_forward_pre_hook(lambda mod, args: seen.append(args[1].dtype))
        with torch.autocast("cpu", torch.bfloat16):
            m(torch.zeros(1, 16, dtype=torch.long))
        assert seen == [torch.float32, torch.float32]
    finally:
        dist.destroy_process_group()


def test_an_elastic_restart_finds_a_dcp_checkpoint_under_a_relative_out_dir(tmp_path, monkeypatch):
    """checkpoint_format='dcp' keeps ckpt.dcp in out_dir; a restart under a relative out_dir (as users write it)
    resumes from it (the path was joined to out_dir twice: out/out/ckpt.dcp, so the restart retrained)."""
    from types import SimpleNamespace

    monkeypatch.chdir(tmp_path)
    os.makedirs(os.path.join("out", "ckpt.dcp"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    run = SimpleNamespace(master=False)
    assert train._elastic_restart(SimpleNamespace(out_dir="out", checkpoint_format="dcp"), run)
    assert not train._elastic_restart(SimpleNamespace(out_dir="out", checkpoint_format="single"), run)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not train._elastic_restart(SimpleNamespace(out_dir="out", checkpoint_format="dcp"), run)


def _fake_checkpoints(out, single=None, dcp=None, stem="ckpt", key="iter_num"):
    """out/STEM.pt and out/STEM.dcp (its extra.pt) holding only KEY (iter_num; best_val_loss for best), where given."""
    os.makedirs(out, exist_ok=True)
    if single is not None:
        torch.save({key: single}, os.path.join(out, f"{stem}.pt"))
    if dcp is not None:
        os.makedirs(os.path.join(out, f"{stem}.dcp"))
        torch.save({key: dcp}, os.path.join(out, f"{stem}.dcp", sharding.EXTRA))


@pytest.mark.parametrize(
    "asked, single, dcp, want, fmt",
    [
        ("single", None, 5, "ckpt.dcp", "dcp"),  # a dcp run resumed without repeating --checkpoint_format=dcp
        ("single", 5, None, "ckpt.pt", "single"),
        ("dcp", None, 5, "ckpt.dcp", "dcp"),
        ("dcp", 5, None, "ckpt.pt", "dcp"),  # read whole, saved sharded from here on
        ("single", 5, 5, "ckpt.pt", "single"),  # just converted (python sharding.py): the format asked
        ("dcp", 5, 5, "ckpt.dcp", "dcp"),
        ("dcp", 7, 5, "ckpt.pt", "dcp"),  # converted, then trained on in the single format: ckpt.dcp is stale
        ("single", 5, 7, "ckpt.dcp", "dcp"),  # converted, then trained on as dcp: ckpt.pt is stale
        ("single", 7, 5, "ckpt.pt", "single"),
        ("dcp", 5, 7, "ckpt.dcp", "dcp"),
        ("single", None, None, "ckpt.pt", "single"),  # neither: initial_state's one line names the file asked for
        ("dcp", None, None, "ckpt.dcp", "dcp"),
    ],
)
def test_a_resume_reads_the_newest_of_ckpt_pt_and_ckpt_dcp(asked, single, dcp, want, fmt, tmp_path, capsys):
    """train._resume_path: of out_dir/ckpt.pt and out_dir/ckpt.dcp, the one of more steps (iter_num; on a tie the
    format asked for), so no step is trained twice; resuming ckpt.dcp sets checkpoint_format='dcp' in both cfg and
    config (the run's settings and what it records and saves by), a ckpt.pt read under 'dcp' leaves it; a one-line
    note names the file wherever it is not the format asked for."""
    from types import SimpleNamespace

    out = str(tmp_path / "out")
    _fake_checkpoints(out, single, dcp)
    cfg = SimpleNamespace(out_dir=out, checkpoint_format=asked)
    config = {"out_dir": out, "checkpoint_format": asked}
    got = train._resume_path(cfg, config, SimpleNamespace(master=True))
    assert got == os.path.join(out, want)
    assert cfg.checkpoint_format == config["checkpoint_format"] == fmt
    lines = capsys.readouterr().out.splitlines()
    if (want == "ckpt.dcp") == (asked == "dcp"):
        assert lines == [], lines
    else:
        assert len(lines) == 1 and lines[0].startswith("note: ") and f"resuming from {got}" in lines[0], lines
        assert "older" in lines[0] or "does not exist" in lines[0], lines


@pytest.mark.parametrize(
    "asked, fsdp, single, dcp, want",
    [
        ("single", False, 1.5, None, "best.pt"),
        ("dcp", True, None, 1.5, "best.dcp"),
        ("dcp", True, 1.5, None, "best.pt"),  # a single-format run resumed as dcp that never improved
        ("single", True, None, 1.5, "best.dcp"),  # a dcp run resumed (converted) in the single format
        ("single", True, 1.6, 1.5, "best.dcp"),  # ... whose best.pt of the earlier phase is worse
        ("single", True, 1.4, 1.5, "best.pt"),  # ... which improved after the resume
        ("dcp", True, 1.4, 1.5, "best.pt"),
        ("dcp", True, 1.6, 1.5, "best.dcp"),
        ("single", True, 1.5, 1.5, "best.pt"),  # a tie: the format asked
        ("dcp", True, 1.5, 1.5, "best.dcp"),
        ("single", False, 1.6, 1.5, "best.pt"),  # best.dcp is better but needs fsdp: a note says how to read it
        ("single", False, None, None, "best.pt"),  # neither: final_evaluation warns and scores the current weights
    ],
)
def test_the_final_evaluation_scores_the_better_of_best_pt_and_best_dcp(
    asked, fsdp, single, dcp, want, tmp_path, capsys
):
    """train._best_path: where a run resumed in the other format left both best.pt and best.dcp, the final
    evaluation scores the one of the lower best_val_loss (the best weights of the whole run; on a tie the format
    asked), not the format setting's, which may be stale; a note names any other choice in one line."""
    from types import SimpleNamespace

    out = str(tmp_path / "out")
    _fake_checkpoints(out, single, dcp, stem="best", key="best_val_loss")
    got = train._best_path(
        SimpleNamespace(out_dir=out, checkpoint_format=asked), SimpleNamespace(master=True, fsdp=fsdp)
    )
    assert got == os.path.join(out, want)
    lines = capsys.readouterr().out.splitlines()
    if single is not None and dcp is not None and dcp < single and not fsdp:
        assert len(lines) == 1 and "needs fsdp=True" in lines[0] and "python sharding.py" in lines[0], lines
    elif (want == "best.dcp") == (asked == "dcp"):
        assert lines == [], lines
    else:
        assert len(lines) == 1 and lines[0].startswith("note: ") and f"scoring {got}" in lines[0], lines


def test_a_dcp_run_resumes_without_its_format_and_after_a_conversion_from_the_newest_checkpoint(
    small_chars, tmp_path, capsys
):
    """Real runs, FSDP in one process, as the docs say a user goes: a checkpoint_format='dcp' run of 2 steps; resumed
    to 3 without repeating --checkpoint_format=dcp, it finds ckpt.dcp, says so in one line, records and saves 'dcp'
    (no ckpt.pt appears); converted (python sharding.py ckpt.dcp ckpt.pt) and trained on to 4 in the default single
    format, ckpt.pt holds step 4 and ckpt.dcp is stale at 3; resumed with --checkpoint_format=dcp to 5, it starts
    from ckpt.pt's step 4 (one line names the stale folder) and saves sharded. No step is logged twice; the stale
    ckpt.dcp is replaced only by the newer one, and ckpt.pt is left as it was."""

    def saved(name):
        file = os.path.join(out, name, sharding.EXTRA) if name.endswith(".dcp") else os.path.join(out, name)
        return torch.load(file, weights_only=True, map_location="cpu")["iter_num"]

    out = str(tmp_path / "run")
    args = [*TINY, f"--data_root={small_chars}", *FSDP, *CASES["rope"], "--gradient_accumulation_steps=1"]
    args += ["--eval_interval=1", "--eval_iters=1", f"--out_dir={out}"]
    train.main([*args, "--checkpoint_format=dcp", "--max_iters=2"])
    capsys.readouterr()
    m = train.main([*args, "--init_from=resume", "--max_iters=3"])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert (
        len(notes) == 1 and f"resuming from {os.path.join(out, 'ckpt.dcp')}, with checkpoint_format='dcp'" in notes[0]
    )
    assert m["config"]["checkpoint_format"] == m["sharding"]["checkpoint_format"] == "dcp" and m["iter_num"] == 3
    assert saved("ckpt.dcp") == 3 and not os.path.exists(os.path.join(out, "ckpt.pt"))
    sharding.main([os.path.join(out, "ckpt.dcp"), os.path.join(out, "ckpt.pt")])
    train.main([*args, "--init_from=resume", "--max_iters=4"])
    assert (saved("ckpt.pt"), saved("ckpt.dcp")) == (4, 3)
    capsys.readouterr()
    m = train.main([*args, "--init_from=resume", "--checkpoint_format=dcp", "--max_iters=5"])
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and f"resuming from {os.path.join(out, 'ckpt.pt')}" in notes[0], notes
    assert m["iter_num"] == 5 and m["config"]["checkpoint_format"] == "dcp"
    assert (saved("ckpt.pt"), saved("ckpt.dcp")) == (4, 5)
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]
    with open(os.path.join(out, "log.jsonl")) as f:
        assert [r["iter"] for r in map(json.loads, f) if "loss" in r] == [1, 2, 3, 4, 5]


def test_a_dcp_run_converted_and_resumed_without_improving_scores_its_best_dcp(small_chars, tmp_path, capsys):
    """Real runs, FSDP in one process: a checkpoint_format='dcp' run of 2 steps (best.dcp), converted (python
    sharding.py) and resumed in the single format for a step at lr 0, which cannot improve on the best so far and
    writes no best.pt: the final evaluation scores best.dcp (the run's best), says so in one line, and records it."""
    out = str(tmp_path / "run")
    args = [*TINY, f"--data_root={small_chars}", *FSDP, *CASES["rope"], "--gradient_accumulation_steps=1"]
    args += ["--eval_interval=1", "--eval_iters=1", f"--out_dir={out}"]
    train.main([*args, "--checkpoint_format=dcp", "--max_iters=2"])
    sharding.main([os.path.join(out, "ckpt.dcp"), os.path.join(out, "ckpt.pt")])
    capsys.readouterr()
    m = train.main([*args, "--init_from=resume", "--max_iters=3", "--learning_rate=0", "--min_lr=0"])
    assert not os.path.exists(os.path.join(out, "best.pt")) and m["checkpoint"] == os.path.join(out, "best.dcp")
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert any(f"scoring {os.path.join(out, 'best.dcp')}" in line for line in notes), notes


def test_a_dcp_folder_written_before_a_model_field_existed_reads_it_as_a_single_file_does(tmp_path):
    """load_dcp_extra, the resume path of checkpoint_format='dcp', gives model_args as load_checkpoint does: a
    field added later (rope_yarn_ramp, issue 60) comes back with the older runs' value, 'paper'."""
    from checkpoint import LEGACY_MODEL_ARGS, load_checkpoint

    args = {"pos_encoding": "rope", "rope_scaling": 4.0, "n_layer": 1}
    folder = tmp_path / "ckpt.dcp"
    folder.mkdir()
    torch.save({"model_args": args, "iter_num": 3}, folder / sharding.EXTRA)
    torch.save({"model": {}, "model_args": args}, tmp_path / "ckpt.pt")
    extra = sharding.load_dcp_extra(str(folder))
    assert (
        extra["model_args"] == load_checkpoint(str(tmp_path), "ckpt.pt")["model_args"] == {**LEGACY_MODEL_ARGS, **args}
    )
    assert extra["model_args"]["rope_yarn_ramp"] == "paper" and extra["iter_num"] == 3


def test_a_dcp_run_from_before_rope_yarn_ramp_resumes_with_the_papers_ramp(small_chars, tmp_path, capsys):
    """A real resume of a checkpoint_format='dcp' folder written before issue 60 (its extra.pt's model_args and
    config without rope_yarn_ramp), under FSDP in one process: the run resumes with the ramp those runs had,
    'paper' (checkpoint.LEGACY_MODEL_ARGS), not today's default 'code', and records it."""
    out = str(tmp_path / "yarn")
    args = [*TINY, f"--data_root={small_chars}", "--pos_encoding=rope", "--rope_scaling=2.0"]
    args += ["--rope_original_block_size=32", *FSDP, "--checkpoint_format=dcp", f"--out_dir={out}"]
    train.main([*args, "--max_iters=5"])
    extra_file = os.path.join(out, "ckpt.dcp", sharding.EXTRA)
    extra = torch.load(extra_file, weights_only=True)
    assert extra["model_args"]["rope_yarn_ramp"] == "code"
    for key in ("model_args", "config"):
        del extra[key]["rope_yarn_ramp"]
    torch.save(extra, extra_file)
    m = train.main([*args, "--init_from=resume", "--max_iters=6"])
    assert m["config"]["rope_yarn_ramp"] == "paper" and m["iter_num"] == 6
    saved = torch.load(extra_file, weights_only=True)
    assert saved["model_args"]["rope_yarn_ramp"] == saved["config"]["rope_yarn_ramp"] == "paper"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of 2 real gloo ranks holds under FSDP2 (tests/fsdp_rank_probe.py, one torchrun launch): a list
    of the two ranks' reports."""
    tmp = tmp_path_factory.mktemp("ranks")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p = subprocess.Popen(
        [*cmd, "tests/fsdp_rank_probe.py", str(tmp)],
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:  # a hung rank fails the test and leaves no orphan
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        raise
    assert p.returncode == 0, err[-4000:]
    return [json.load(open(tmp / f"rank{r}.json")) for r in range(2)]


def test_the_bf16_policy_reduces_gradients_in_float32_on_two_ranks(ranks):
    """bf16 compute, fp32 reduce: the two ranks' bf16 gradients (different data) are summed and averaged in fp32,
    so the reduced shards keep bits no bf16 value has (more than a quarter of the elements here); reduced in bf16
    every element would be a bf16 value. The shards are fp32 (the master weights' dtype) either way."""
    assert sharding.mixed_precision("bfloat16") == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    for r in ranks:
        assert r["bf16"]["grad_dtypes"] == ["torch.float32"]
        assert r["bf16"]["not_bf16"] > r["bf16"]["elements"] / 4, r["bf16"]


def test_a_gathered_checkpoint_lives_whole_on_rank_0s_cpu_and_nowhere_else(ranks):
    """sharding.full_states on 2 ranks (what train.py saves ckpt.pt from): rank 0 gets every tensor whole, on the CPU,
    as plain tensors equal to the shards' full_tensor(), and AdamW's state of every parameter; rank 1 gets nothing,
    so no rank but the writer ever holds the whole model (on a GPU: not in its memory at all; a 1.5B model's
    18 GB of state gathered on every GPU would not fit)."""
    g0, g1 = ranks[0]["gathered"], ranks[1]["gathered"]
    assert g0["model_keys"] == g0["keys"] == 10 and g0["optimizer_states"] == 9
    assert g0["devices"] == ["cpu"] and not g0["dtensor"] and g0["equal"] is True
    assert (g1["model_keys"], g1["optimizer_states"], g1["devices"]) == (0, 0, [])


def test_bytes_per_rank_when_rows_do_not_divide_by_the_ranks_or_are_fewer(ranks):
    """A PoPE GPT whose embedding has 65 rows (33 on rank 0, 32 on rank 1) and whose δ has one row (one key/value
    head: rank 0 holds it, rank 1 nothing): memory_per_rank's estimate is rank 0's measurement on 2 real ranks,
    parameters, gradients and AdamW state; rank 1 holds one embedding row (32 floats) and δ's row (16) fewer,
    three times over in the optimizer. Hand-worked, tensors of 1 x 3, 5 x 2 and 65 rows: rank 0 holds
    1 + 3 + 33 rows at world 2 (3 + 6 + 33 = 42 floats), 1 + 2 + 17 at world 4 (3 + 4 + 17 = 24), 1 + 1 + 9 at
    world 8 (3 + 2 + 9 = 14), all 78 floats at world 1."""
    b0, b1 = ranks[0]["bytes"], ranks[1]["bytes"]
    assert b0["measured"] == b0["estimate"] == b1["estimate"]
    less = 4 * (32 + 16)
    for key, times in (("params", 1), ("grads", 1), ("optimizer", 2)):
        assert b1["measured"][key] == b0["measured"][key] - times * less, key
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(*s)) for s in ((1, 3), (5, 2), (65,))])
    for world, floats in ((1, 78), (2, 42), (4, 24), (8, 14)):
        got = sharding.memory_per_rank(params, world)["fsdp"]
        assert got["params"] == got["grads"] == 4 * floats, (world, got)
        assert got["optimizer"] == 4 * 2 * floats + 4 * 3, (world, got)


def test_one_micro_step_per_rank_holds_sharded_gradients_whichever_reduce_choice(monkeypatch, capsys):
    """fsdp_reduce_every_micro_step=False holds whole fp32 gradients only between micro-steps that do not reduce: with
    one micro-step per rank the only backward reduce-scatters (set_grad_sync's sync), so each rank holds its shard,
    as with True. Hand-worked, tensors of 1 x 3, 5 x 2 and 65 rows (78 floats) at world 2: rank 0 holds 1 + 3 + 33
    rows (42 floats) of the gradients at one micro-step under either choice, all 78 at two micro-steps under False
    (DDP: 78 always). Through train.shard_model at world 2 with 2 micro-steps in all (gradient_accumulation_steps=2,
    one per rank): the recorded estimate's gradients are its parameters' bytes (sharded alike) and the printed FSDP
    line says so, without the two choices' costs (they differ only at several micro-steps per rank); at 2 micro-steps
    per rank they are 4 bytes per parameter."""
    params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(*s)) for s in ((1, 3), (5, 2), (65,))])
    for accum, every, floats in ((1, False, 42), (1, True, 42), (2, True, 42), (2, False, 78)):
        got = sharding.memory_per_rank(params, 2, accum, every)
        assert got["fsdp"]["grads"] == 4 * floats and got["fsdp"]["params"] == 4 * 42, (accum, every, got)
        assert got["ddp"]["grads"] == 4 * 78
    from types import SimpleNamespace

    monkeypatch.setattr(
        sharding, "shard", lambda model, dev, dtype, mesh=None: sharding.mixed_precision(dtype)
    )  # no group
    gptconf = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=16)
    model = GPT(gptconf)
    whole = 4 * sum(p.numel() for p in model.parameters())
    cfg = SimpleNamespace(fsdp=True, activation_checkpointing=False, batch_size=2, checkpoint_format="single")
    cfg.gradient_accumulation_steps = 2
    for per_rank in (1, 2):
        run = SimpleNamespace(
            world_size=2, grad_accum=per_rank, fsdp_reduce_every_micro_step=False, master=True, cp=None
        )
        run.__dict__.update(dev="cpu", device_type="cpu", dtype="float32")
        train.shard_model(cfg, run, model, gptconf)
        est = run.sharding["memory_per_rank"]["estimate"]
        assert est["params"] < whole and est["grads"] == (est["params"] if per_rank == 1 else whole), (per_rank, est)
        out = capsys.readouterr().out
        fsdp_line = next(line for line in out.splitlines() if line.lstrip().startswith("FSDP"))
        assert f"grads {sharding.gib(est['grads'])}," in fsdp_line, fsdp_line
        assert ("(fsdp_reduce_every_micro_step)" in out) == (per_rank > 1)  # the choices differ only then


def test_a_resume_under_fsdp_reads_the_whole_checkpoint_to_the_cpu_not_the_runs_device(tmp_path):
    """Under FSDP every rank reads the whole ckpt.pt (and best.pt for an evaluation) before it keeps its shard: to
    the CPU, not to its GPU (a 1.5B model's 18 GB of weights and AdamW state on every GPU). Without FSDP the file
    goes straight to the run's device. The `meta` device stands in for the GPU (a real device: torch.load's
    map_location honours it): train._resume_checkpoint gives CPU tensors under FSDP and meta tensors without;
    train.load_weights under FSDP loads best.pt's weights into a CPU model (meta tensors could not be copied)."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    args = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    model = GPT(GPTConfig(**args))
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    opt.step()
    for name in ("ckpt.pt", "best.pt"):
        torch.save({"model": model.state_dict(), "model_args": args, "optimizer": opt.state_dict()}, tmp_path / name)
    cfg = SimpleNamespace(checkpoint_format="single", out_dir=str(tmp_path), fsdp=True)
    for fsdp, device in ((True, "cpu"), (False, "meta")):
        state = train._resume_checkpoint(cfg, SimpleNamespace(fsdp=fsdp, dev="meta"), str(tmp_path / "ckpt.pt"))
        tensors = list(state["model"].values()) + [t for s in state["optimizer"]["state"].values() for t in s.values()]
        assert {t.device.type for t in tensors} == {device}, fsdp
    fresh = GPT(GPTConfig(**args))
    train.load_weights(SimpleNamespace(fsdp=True, dev="meta"), fresh, str(tmp_path / "best.pt"))
    for (n, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), n


def test_an_unreadable_checkpoint_beside_another_is_refused_in_one_line_naming_it(tmp_path):
    """train._saved_iter (a resume or final evaluation choosing between ckpt.pt and ckpt.dcp): a file that is not
    tensors and plain values, and a dcp folder without the key, give one line naming the path and the reason, never
    torch's advice to load with weights_only=False."""
    import datetime

    from cli import UserError

    bad = tmp_path / "ckpt.pt"
    torch.save({"iter_num": 3, "when": datetime.datetime(2026, 1, 1)}, bad)
    os.makedirs(tmp_path / "ckpt.dcp")
    torch.save({"best_val_loss": 1.5}, tmp_path / "ckpt.dcp" / sharding.EXTRA)
    for path, why in ((str(bad), "not a file of tensors and plain values"), (str(tmp_path / "ckpt.dcp"), "KeyError")):
        with pytest.raises(UserError) as e:
            train._saved_iter(path)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and path in msg and why in msg and "weights_only" not in msg, msg


def test_grad_bytes_counts_a_whole_gradient_held_under_two_names_once():
    """sharding.grad_bytes on FSDP2's private fields, spelled as two torch releases spell them: torch 2.13 keeps
    unsharded_accumulated_grad as its own tensor (mixed precision: an fp32 sum beside the bf16 .grad), torch 2.15
    makes it a property returning _unsharded_param.grad. The alias counts once (it counted twice under 2.15:
    the FSDP memory tests measured 2x the whole gradients); two tensors count both."""
    from types import SimpleNamespace

    g16 = torch.zeros(8, 4, dtype=torch.bfloat16)
    g32 = torch.zeros(8, 4)

    class Holder(torch.nn.Module):
        def __init__(self, accumulated, grad):
            super().__init__()
            param = SimpleNamespace(unsharded_accumulated_grad=accumulated, _unsharded_param=SimpleNamespace(grad=grad))
            self.state = SimpleNamespace(_fsdp_param_group=SimpleNamespace(fsdp_params=[param]))

        def _get_fsdp_state(self):
            return self.state

    assert sharding.grad_bytes(Holder(g32, g32)) == 8 * 4 * 4  # torch 2.15: one tensor, two names
    assert sharding.grad_bytes(Holder(g32, g16)) == 8 * 4 * 4 + 8 * 4 * 2  # torch 2.13, mixed precision: two
    assert sharding.grad_bytes(Holder(None, g16)) == 8 * 4 * 2
