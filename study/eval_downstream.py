"""Zero-shot downstream evaluation of run folders through EleutherAI's lm-evaluation-harness.

    python study/eval_downstream.py out-owt-124m-rope out-owt-124m-pope
    python study/eval_downstream.py out-owt-124m-pope --tasks=lambada_openai,piqa --limit=200
    python study/eval_downstream.py out-x --tasks=my_task --include_path=my_tasks/   # local task YAMLs

The paper's table (section "Downstream tasks"): zero-shot accuracy on LAMBADA (OpenAI's detokenized
version), BLiMP (mean over its 67 subtasks), CBT (mean over CN and NE), HellaSwag, PIQA and ARC-Easy,
and their average. `TASKS` names the harness task and metric of each column. CBT is not in the
harness: its task definition ships in study/eval_tasks/cbt/ and is always on the include path.

`GPTLM` is an `lm_eval` model (registered as "pope-gpt") that wraps this repo's GPT and its GPT-2
tokenizer, found through checkpoint.py like sample.py finds it. Every model sees at most block_size
tokens: longer inputs are left-truncated (the harness's convention), for every positional encoding,
so absolute encodings are never fed past their length.

Output: a markdown table, one row per run folder, printed and written to <out_dir>/results.md,
with the harness's raw JSON per run (<out_dir>/<run>.json); both written atomically.
Bad input (no best.pt, an unknown task name, a tokenizer that is not GPT-2, an unreachable dataset)
exits with code 2 and a one-line error. The harness reads its datasets from the Hugging Face hub;
docs/downstream.md explains offline use (HF_DATASETS_OFFLINE, a local cache).
"""

import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: cli.py, model.py ...

from checkpoint import load_codec, load_run, tokenizer_from_checkpoint
from cli import UserError, atomic_write, atomic_write_json, exit_on_user_error, resolve_device
from configurator import configure
from model import KVCache

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_TASKS = os.path.join(HERE, "eval_tasks")  # task definitions the harness lacks (CBT)
# column -> (harness task or group, metric); acc_norm is the length-normalised log-likelihood choice
TASKS = {
    "LAMBADA": ("lambada_openai", "acc"),
    "BLiMP": ("blimp", "acc"),
    "CBT": ("cbt", "acc"),
    "HellaSwag": ("hellaswag", "acc_norm"),
    "PIQA": ("piqa", "acc_norm"),
    "ARC-E": ("arc_easy", "acc_norm"),
}
OTHER_METRICS = ("acc", "exact_match")  # tasks outside TASKS: the first of these they report

DEFAULTS = dict(
    tasks=",".join(t for t, _ in TASKS.values()),
    limit=None,  # examples per task (int), or a fraction (float); None = all (the paper)
    include_path="",  # extra folder(s) of task YAMLs, comma-separated
    out_dir="out-downstream",
    ckpt="best.pt",
    batch_size=16,
    device="auto",
    attn_backend="auto",
    seed=1234,
)


@functools.cache
def gpt_lm_class():
    """The class GPTLM, defined and registered once; lm_eval is imported here (it takes seconds)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    @register_model("pope-gpt")
    class GPTLM(TemplateLM):
        """lm_eval model for a GPT of this repo and a GPT-2 BPE (encode, decode) pair.

        model: GPT in eval mode; max_length = model.config.block_size tokens for every encoding.
        Log-likelihoods are natural logs (nats), computed in float32 from the model's logits.
        """

        def __init__(self, model, encode, decode, eot_token_id=50256, batch_size=16, device="cpu"):
            super().__init__()
            self.model, self._encode, self._decode = model, encode, decode
            self._eot, self.batch_size, self._device = eot_token_id, int(batch_size), torch.device(device)
            self.max_length = model.config.block_size

        @property
        def eot_token_id(self):
            return self._eot

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return self._encode(string)

        def tok_decode(self, tokens, **kwargs):
            return self._decode(list(tokens))

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            """requests: [(key, context ids, continuation ids)] -> [(sum log p(continuation), is_greedy)].

            The input is (context + continuation)[:-1], left-truncated to max_length tokens; batches of
            similar length are right-padded (causal attention: padding never reaches real tokens).
            Raises ValueError if a continuation alone is longer than max_length.
            """
            L = self.max_length
            coll = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
            out = []
            for batch in coll.get_batched(n=self.batch_size):
                rows, conts = [], []
                for _, ctx, cont in batch:
                    if len(cont) > L:
                        raise ValueError(f"a continuation of {len(cont)} tokens exceeds block_size {L}")
                    rows.append((ctx + cont)[-(L + 1) :][:-1])
                    conts.append(cont)
                width = max(map(len, rows))
                x = torch.zeros(len(rows), width, dtype=torch.long)
                for i, r in enumerate(rows):
                    x[i, : len(r)] = torch.tensor(r)
                logits, _ = self.model(x.to(self._device))
                for i, (row, cont) in enumerate(zip(rows, conts)):
                    lp = logits[i, len(row) - len(cont) : len(row)].float()  # (len(cont), vocab)
                    lp = F.log_softmax(lp, dim=-1).cpu()
                    target = torch.tensor(cont)
                    is_greedy = bool((lp.argmax(dim=-1) == target).all())
                    ll = float(lp.gather(1, target[:, None]).sum())
                    out.append((ll, is_greedy))
                    if batch[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", batch[i][0], (ll, is_greedy))
            return coll.get_original(out)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            """Sum of log p over all tokens of each string: disjoint windows of max_length tokens,
            the first conditioned on EOT (the harness's rolling-window convention)."""
            out = []
            for (text,) in [r.args for r in requests]:
                windows = [
                    (None,) + make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        self.tok_encode(text),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                out.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
            return out

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm=False):
            """Greedy continuation of each context through the KV cache, cut before the first stop string.

            At most min(max_gen_toks, max_length - 1) new tokens; the context is left-truncated so that
            context + generation never exceeds max_length tokens. EOT is always a stop string.
            """
            out = []
            for context, gen_kwargs in [r.args for r in requests]:
                kw = normalize_gen_kwargs(gen_kwargs)
                stops = handle_stop_sequences(kw["until"], eos=self.tok_decode([self._eot]))
                n_new = max(1, min(kw["max_gen_toks"], self.max_length - 1))
                ids = self.tok_encode(context)[-(self.max_length - n_new) :] or [self._eot]
                cache = KVCache(self.model.config.n_layer, len(ids) + n_new)
                x = torch.tensor([ids], device=self._device)
                gen, text = [], ""
                for _ in range(n_new):
                    logits, _ = self.model(x, kv_cache=cache)
                    nxt = int(logits[0, -1].argmax())
                    gen.append(nxt)
                    text = self.tok_decode(gen)
                    if any(s in text for s in stops):
                        break
                    x = torch.tensor([[nxt]], device=self._device)
                for s in stops:
                    text = text.split(s)[0]
                out.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            return out

    return GPTLM


def build_lm(out_dir, ckpt="best.pt", batch_size=16, device="cpu", attn_backend="auto"):
    """GPTLM for a run folder. Raises UserError (no checkpoint, or a tokenizer that is not GPT-2)."""
    model, state = load_run(out_dir, ckpt, device, attn_backend=attn_backend)
    meta = tokenizer_from_checkpoint(state)
    kind = (meta.get("tokenizer") or {}).get("kind")
    if kind != "gpt2":
        raise UserError(
            f"{out_dir} was trained on '{meta.get('dataset')}' with a {kind!r} tokenizer; the "
            "downstream tasks are English text and need a GPT-2 BPE model"
        )
    encode, decode = load_codec(meta)
    return gpt_lm_class()(model, encode, decode, batch_size=batch_size, device=device)


def task_manager(include_path="", include_defaults=True):
    """lm_eval TaskManager over the harness's tasks (unless include_defaults=False: indexing them
    takes seconds), study/eval_tasks/ and the comma-separated folders of include_path.

    Raises UserError if a folder does not exist."""
    from lm_eval.tasks import TaskManager

    paths = [LOCAL_TASKS] + [p for p in include_path.split(",") if p]
    for p in paths:
        if not os.path.isdir(p):
            raise UserError(f"--include_path {p}: no such folder of task YAMLs")
    return TaskManager(include_path=paths, include_defaults=include_defaults)


def column(task, results):
    """(column name, metric, value in [0, 1] or None) of one requested task in harness results."""
    name, metric = next(((c, m) for c, (t, m) in TASKS.items() if t == task), (task, None))
    res = results.get("results", {}).get(task, {})
    for m in [metric] if metric else OTHER_METRICS:
        if f"{m},none" in res:
            return name, m, res[f"{m},none"]
    return name, metric or OTHER_METRICS[0], None


def markdown_table(rows, tasks):
    """rows: [(run name, harness results)] -> markdown table, accuracies in %, average over the tasks."""
    cols = [column(t, rows[0][1])[:2] for t in tasks] if rows else []
    lines = ["| run | " + " | ".join(f"{c} ({m})" for c, m in cols) + " | average |", "|---" * (len(cols) + 2) + "|"]
    for run, res in rows:
        vals = [column(t, res)[2] for t in tasks]
        cells = ["—" if v is None else f"{100 * v:.2f}" for v in vals]
        avg = "—" if None in vals or not vals else f"{100 * sum(vals) / len(vals):.2f}"
        lines.append(f"| {run} | " + " | ".join(cells) + f" | {avg} |")
    return "\n".join(lines) + "\n"


def evaluate_run(lm, tasks, tm, limit=None, seed=1234):
    """Harness results dict (simple_evaluate, zero-shot, no sample logs) of one GPTLM on `tasks`."""
    from lm_eval import evaluator

    return evaluator.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=0,
        limit=limit,
        task_manager=tm,
        log_samples=False,
        bootstrap_iters=0,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


@exit_on_user_error
def main(argv):
    runs = [a for a in argv if not a.startswith("--")]
    cfg = configure(DEFAULTS, [a for a in argv if a.startswith("--")])
    dev = resolve_device(cfg["device"])
    tasks = [t for t in cfg["tasks"].split(",") if t]
    if not runs:
        raise UserError("give one or more run folders: python study/eval_downstream.py out-owt-124m-pope [--tasks=...]")
    lms = [build_lm(r, cfg["ckpt"], cfg["batch_size"], dev, cfg["attn_backend"]) for r in runs]
    tm = task_manager(cfg["include_path"])
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown or not tasks:
        raise UserError(
            f"unknown task(s) {unknown or tasks}: use harness task names (lm-eval ls tasks) or "
            "add a folder of task YAMLs with --include_path"
        )
    os.makedirs(cfg["out_dir"], exist_ok=True)
    rows = []
    for run, lm in zip(runs, lms):
        t0 = time.time()
        try:
            res = evaluate_run(lm, tasks, tm, cfg["limit"], cfg["seed"])
        except (OSError, ConnectionError) as e:  # the hub unreachable, a data file missing
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"cannot load the task data ({type(e).__name__}: {msg}); for offline use, fill the HF "
                "cache (HF_HOME) and set HF_DATASETS_OFFLINE=1 (docs/downstream.md)"
            ) from None
        name = os.path.basename(os.path.normpath(run))
        print(f"{name}: {time.time() - t0:.1f} s", file=sys.stderr)
        atomic_write_json(os.path.join(cfg["out_dir"], f"{name}.json"), res, indent=2, default=str)
        rows.append((name, res))
    table = markdown_table(rows, tasks)
    atomic_write(os.path.join(cfg["out_dir"], "results.md"), table)
    print(table)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
