"""lm-evaluation-harness's `hf` backend on an exported folder against study/eval_downstream.py's adapter (GPTLM) on the
same checkpoint: the same log-likelihoods, greedy flags, rolling sums and generations. Real lm_eval and transformers,
fp32, CPU, local tasks only (no network). The model: tests/test_hf_export.py's built_model (peaked attention, GQA),
GPT-2 BPE; contexts longer than block_size are left-truncated by both."""

import pytest
import torch

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from test_eval_downstream import instances, write_local_tasks  # noqa: E402
from test_hf_export import GPT2_TOKENIZER, L, built_model, save_run  # noqa: E402

import eval_downstream as ed  # noqa: E402
from checkpoint import load_codec, load_run  # noqa: E402
from hf import export as hf_export  # noqa: E402

LONG = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness,"
    " it was the epoch of belief"
)


@pytest.fixture(scope="module")
def exported_pair(tmp_path_factory):
    """(the adapter's GPTLM, the exported folder) of one GPT-2 BPE PoPE run."""
    mp = pytest.MonkeyPatch()
    for k, v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("GPT2_BPE_SOURCE", "local")):
        mp.setenv(k, v)
    root = tmp_path_factory.mktemp("hf_lm_eval")
    run = save_run(root / "run", built_model(50304, seed=6, pos_encoding="pope"), GPT2_TOKENIZER)
    out = hf_export.export(run, str(root / f"hf-{root.name}"))  # a name of its own: test_hf_export.exported
    model, state = load_run(run)
    encode, decode = load_codec(state["tokenizer"])
    yield ed.gpt_lm_class()(model, encode, decode, batch_size=3), out
    mp.undo()


def hf_lm(folder):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=folder, trust_remote_code=True, dtype="float32", device="cpu", batch_size=3)


def test_loglikelihoods_equal_the_adapters(exported_pair):
    adapter, out = exported_pair
    lm = hf_lm(out)
    assert lm.max_length == L and lm.eot_token_id == 50256
    pairs = [
        ("The cat sat on the", " mat"),
        ("One, two,", " three four five"),
        ("", "Hello world"),
        (LONG, " and the spring of hope"),  # longer than block_size: left-truncated
        ("Hello", " there"),
    ]
    assert len(adapter.tok_encode(LONG)) > L
    want = adapter.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    got = lm.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    for (ll_w, greedy_w), (ll_g, greedy_g) in zip(want, got):
        assert ll_g == pytest.approx(ll_w, rel=1e-5, abs=1e-5) and greedy_g == greedy_w
    assert len({round(ll, 3) for ll, _ in want}) == len(pairs)  # distinct answers: the comparison sees each one
    text = LONG + ", it was the epoch of incredulity, it was the season of Light, it was the season of Darkness"
    rolling_w = adapter.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    rolling_g = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,)]), disable_tqdm=True)
    assert rolling_g[0] == pytest.approx(rolling_w[0], rel=1e-5)


def test_the_hf_backend_by_name_gives_the_adapters_task_results(exported_pair, tmp_path):
    """lm_eval's simple_evaluate with model='hf' (as `lm_eval --model hf --model_args pretrained=DIR,...` runs it) on a
    local multiple-choice and a generation task: per-sample log-likelihoods and generated text equal the adapter's."""
    from lm_eval import evaluator

    adapter, out = exported_pair
    mc = [
        {"context": "The cat sat on the", "choices": [" mat", " moon", " dog"], "label": 0},
        {"context": LONG, "choices": [" and", " but"], "label": 1},
        {"context": "One, two,", "choices": [" three", " banana"], "label": 0},
    ]
    gens = [{"prompt": "Hello there, my", "target": "x"}, {"prompt": LONG, "target": "y"}]
    write_local_tasks(tmp_path, mc, gens)
    tm = ed.task_manager(str(tmp_path), include_defaults=False)
    common = dict(tasks=["toy_mc", "toy_gen"], num_fewshot=0, task_manager=tm, log_samples=True, bootstrap_iters=0)
    want = evaluator.simple_evaluate(model=adapter, **common)
    got = evaluator.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,dtype=float32",
        device="cpu",
        batch_size=2,
        **common,
    )
    for task in ("toy_mc", "toy_gen"):
        w = sorted(want["samples"][task], key=lambda s: s["doc_id"])
        g = sorted(got["samples"][task], key=lambda s: s["doc_id"])
        assert len(w) == len(g) > 0
        for sw, sg in zip(w, g):
            if task == "toy_mc":
                lls_w = [float(r[0][0]) for r in sw["resps"]]
                lls_g = [float(r[0][0]) for r in sg["resps"]]
                assert lls_g == pytest.approx(lls_w, rel=1e-5, abs=1e-5)
            else:
                assert sg["resps"] == sw["resps"] and sw["resps"][0][0]  # the same non-empty text
    assert got["results"]["toy_mc"]["acc,none"] == want["results"]["toy_mc"]["acc,none"]


def test_the_backends_model_call_equals_gpt_forward_on_right_padded_rows(exported_pair):
    """The call lm-eval's hf backend makes for log-likelihoods: model(ids).logits, no mask, right-padded rows."""
    adapter, out = exported_pair
    lm = hf_lm(out)
    ids = torch.tensor([[464, 3797, 3332, 319, 262], [15496, 995, 0, 0, 0]])
    with torch.no_grad():
        assert torch.allclose(lm._model_call(ids), adapter.model(ids)[0], rtol=1e-5, atol=1e-5)


def documented_char_model_args():
    """The --model_args of docs/hf.md's lm_eval command for a character-level export (its one line that sets
    prefix_token_id)."""
    import os
    import re

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "hf.md")) as f:
        found = re.findall(r"--model_args (\S*prefix_token_id=\S*)", f.read())
    assert len(found) == 1, found
    return found[0]


def test_the_documented_command_scores_a_character_export(tmp_path, monkeypatch):
    """A character vocabulary has no end-of-text token, and lm-eval's hf backend needs one to condition a
    continuation with an empty context. docs/hf.md's command for character exports runs lm_eval's hf backend by name
    on a local multiple-choice task, one context empty: each choice's log-likelihood is the repo's GPT.forward's,
    summed in float64, the empty context conditioned on the documented prefix token."""
    import json
    import re

    from lm_eval import evaluator
    from test_hf_export import CHAR_TEXT, CHAR_TOKENIZER, ITOS, char_ids

    for k, v in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(k, v)
    run = save_run(tmp_path / "run", built_model(len(ITOS), seed=8, pos_encoding="pope"), CHAR_TOKENIZER)
    out = hf_export.export(run, str(tmp_path / f"hf-{tmp_path.name}"))
    model_args = documented_char_model_args()
    prefix = int(re.search(r"prefix_token_id=(\d+)", model_args).group(1))
    model_args = re.sub(r"pretrained=[^,]*", f"pretrained={out}", model_args)
    gpt, _ = load_run(run)
    mc = [
        {"context": "to be, or not to", "choices": [" be", " bee", " the"], "label": 0},
        {"context": "", "choices": ["to be", "that is"], "label": 0},
        {"context": CHAR_TEXT[:49], "choices": [" question", " to be"], "label": 1},  # left-truncated
    ]
    with open(tmp_path / "mc.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in mc)
    (tmp_path / "char_mc.yaml").write_text(
        f"task: char_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    got = evaluator.simple_evaluate(
        model="hf",
        model_args=model_args,
        device="cpu",
        batch_size=2,
        tasks=["char_mc"],
        num_fewshot=0,
        task_manager=ed.task_manager(str(tmp_path), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )

    def ll(context, choice):
        ctx = char_ids(context) or [prefix]
        whole = (ctx + char_ids(choice))[-(L + 1) :]
        with torch.no_grad():
            logp = torch.log_softmax(gpt(torch.tensor([whole[:-1]]))[0][0].double(), dim=-1)
        n = len(choice)
        return float(logp[-n:].gather(1, torch.tensor(whole[-n:])[:, None]).sum())

    samples = sorted(got["samples"]["char_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(mc)
    for doc, sample in zip(mc, samples):
        want = [ll(doc["context"], c) for c in doc["choices"]]
        assert [float(r[0][0]) for r in sample["resps"]] == pytest.approx(want, rel=1e-5, abs=1e-5)
