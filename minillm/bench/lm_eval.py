"""lm-evaluation-harness against ``minillm serve``, beside Hugging Face on the same task (issue 44,
"checked from outside"; the serving rung, docs/SERVING.md): ``python -m minillm.bench.lm_eval``,
``make eval``.

Two small tasks ship with the package (``minillm/data/lm_eval/``: a JSONL and a task YAML each,
so nothing comes from a hub): ``minillm_facts_mc``, multiple choice scored by log-likelihood,
which lm-eval's ``local-completions`` asks as ``echo`` + ``logprobs`` + ``max_tokens: 1`` over
the context's and the choice's token ids; and ``minillm_arith_gen``, greedy answers through
the chat template (``local-chat-completions``), the last number compared with the expected one.

lm-eval pins its own dependencies, so it never goes into the project's environment:
``ensure_venv`` makes ``.venv-lmeval`` beside it (once), as ``vllm_peer`` does for vLLM. The
script starts ``python -m minillm serve`` (SmolLM2, fp32) on a free port, runs lm-eval on both
tasks, stops the server, then scores the same tasks with transformers directly (the model's own
log-softmax over the same token ids; ``generate`` greedy on the same chat) and compares them
item by item: the per-choice log-likelihoods, the greedy flags, the generated texts.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-lmeval"
LM_EVAL = "lm-eval[api]==0.4.13"      # pinned: its request shapes are what this file mirrors
TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
MC_TASK, GEN_TASK = "minillm_facts_mc", "minillm_arith_gen"
MODEL = "smollm2-135m-instruct"


# --- the tasks, as the YAML files describe them ----------------------------------------------------
def task_config(task: str) -> dict:
    import yaml

    return yaml.safe_load((TASK_DIR / f"{task}.yaml").read_text())


def task_docs(task: str) -> list[dict]:
    """The documents of ``task``: its JSONL's lines (the YAML's ``data_files`` test split)."""
    path = TASK_DIR / task_config(task)["dataset_kwargs"]["data_files"]["test"]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render(template: str, doc: dict) -> str:
    """A YAML ``doc_to_text`` for one document (Jinja2, as lm-eval renders it)."""
    from jinja2 import Template

    return Template(template).render(**doc)


def last_number(text: str) -> str:
    """The generation task's filter (its YAML's ``regex`` with ``group_select: -1``)."""
    found = re.findall(r"(-?[0-9]+)", text)
    return found[-1].strip() if found else "[invalid]"


# --- the reference: Hugging Face transformers directly ---------------------------------------------
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) into token ids: trailing spaces move to the
    continuation, the whole is encoded once (no special tokens) and cut after the context's
    tokens, so a token that spans the boundary is not split differently on the two sides."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n_context = len(tokenizer.encode(context, add_special_tokens=False))
    return whole[:n_context], whole[n_context:]


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context, and whether greedy decoding would
    produce it: the fp32 log-softmax of one forward over ``context + continuation``."""
    import torch

    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(continuation)
    total = logprobs.gather(1, target[:, None]).sum().item()
    return total, bool((logprobs.argmax(-1) == target).all())


def hf_generate(model, tokenizer, messages: list[dict], max_tokens: int, until: list[str]) -> str:
    """Greedy answer to a chat through the model's own chat template, cut at the first stop."""
    import torch

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                             do_sample=False, max_new_tokens=max_tokens,
                             pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    for stop in until:
        text = text.split(stop)[0]
    return text


def hf_scores(model_dir: Path, limit: int | None) -> dict:
    """Both tasks scored with transformers: per choice (context, continuation, log-likelihood,
    greedy) and per question the answer, as lm-eval would score them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = task_config(MC_TASK)
    mc = []
    for doc in task_docs(MC_TASK)[:limit]:
        context = render(cfg["doc_to_text"], doc)
        lls = [hf_loglikelihood(model, *encode_pair(tok, context, " " + c)) for c in doc["choices"]]
        mc.append({"context": context, "choices": doc["choices"],
                   "answer": doc["answer"], "ll": [ll for ll, _ in lls],
                   "greedy": [g for _, g in lls]})
    gen_cfg = task_config(GEN_TASK)
    kw = gen_cfg["generation_kwargs"]
    gen = []
    for doc in task_docs(GEN_TASK)[:limit]:
        messages = [{"role": "user", "content": render(gen_cfg["doc_to_text"], doc)}]
        text = hf_generate(model, tok, messages, kw["max_gen_toks"], kw["until"])
        gen.append({"messages": messages, "text": text, "target": doc["answer"]})
    return {"mc": mc, "gen": gen}


def mc_metrics(lls: list[list[float]], choices: list[list[str]], answers: list[int]) -> dict:
    """lm-eval's ``acc`` (the most likely choice) and ``acc_norm`` (per character)."""
    def argmax(xs):
        return max(range(len(xs)), key=xs.__getitem__)
    acc = [argmax(ll) == a for ll, a in zip(lls, answers)]
    norm = [argmax([v / len(c) for v, c in zip(ll, cs)]) == a
            for ll, cs, a in zip(lls, choices, answers)]
    return {"acc": sum(acc) / len(acc), "acc_norm": sum(norm) / len(norm)}


# --- lm-eval in its own environment ----------------------------------------------------------------
def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv() -> Path:
    """``.venv-lmeval`` with lm-eval's API extra (no torch: it only sends requests; transformers
    for the tokenizer ``local-completions`` counts context tokens with), made once."""
    py = venv_python()
    if py.exists() and subprocess.run([str(py), "-c", "import lm_eval, transformers"],
                                      capture_output=True).returncode == 0:
        return py
    print(f"[minillm] installing {LM_EVAL} into {VENV} (once, ~2 min)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", LM_EVAL, "transformers"], check=True)
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(log_path: Path, timeout_s: float, extra: list[str]):
    """``python -m minillm serve`` (SmolLM2, fp32) on a free port: yields its base URL once
    ``/health`` answers; the server is stopped on every way out (SIGTERM, then SIGKILL)."""
    port = free_port()
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", MODEL, "--dtype", "float32",
           "--port", str(port), "--no-dashboard", *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text()[-3000:]      # the log goes with its temporary dir
                why = (f"exit status {proc.returncode}" if proc.poll() is not None
                       else f"no /health in {timeout_s:.0f} s")
                raise RuntimeError(f"the server did not start ({why}):\n{tail}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_lm_eval(py: Path, model: str, args: str, task: str, out: Path, limit: int | None,
                timeout_s: float, chat: bool) -> tuple[dict, list[dict]]:
    """One lm-eval run of ``task`` (offline: the data is local); its results and its samples."""
    cmd = [str(py), "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", task,
           "--include_path", str(TASK_DIR), "--log_samples", "--output_path", str(out)]
    cmd += ["--apply_chat_template"] if chat else []
    cmd += ["--limit", str(limit)] if limit else []
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    print(f"[minillm] lm_eval --model {model} --tasks {task}", flush=True)
    done = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"lm_eval failed ({done.returncode}):\n{done.stderr[-3000:]}")
    results = json.loads(Path(glob.glob(f"{out}/**/results_*.json", recursive=True)[0]).read_text())
    samples = Path(glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)[0])
    return results["results"][task], [json.loads(s) for s in samples.read_text().splitlines()]


def lm_eval_runs(py: Path, tokenizer_dir: Path, limit: int | None, concurrent: int,
                 timeout_s: float, work: Path) -> dict:
    """Both tasks through ``minillm serve``: log-likelihood over ``/v1/completions`` (token ids,
    counted with the model's own tokenizer), generation over ``/v1/chat/completions``."""
    with served(work / "server.log", timeout_s, []) as url:
        common = f"model={MODEL},num_concurrent={concurrent},max_retries=1,timeout={int(timeout_s)}"
        mc = run_lm_eval(py, "local-completions",
                         f"{common},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                         f"tokenizer={tokenizer_dir}", MC_TASK, work / "mc", limit, timeout_s,
                         chat=False)
        gen = run_lm_eval(py, "local-chat-completions",
                          f"{common},base_url={url}/v1/chat/completions", GEN_TASK, work / "gen",
                          limit, timeout_s, chat=True)
    return {"mc": mc, "gen": gen}


# --- side by side ----------------------------------------------------------------------------------
def compare(served_runs: dict, hf: dict) -> dict:
    """Scores both ways and item-by-item differences (lm-eval's samples are in document order)."""
    (mc_res, mc_samples), (gen_res, gen_samples) = served_runs["mc"], served_runs["gen"]
    mc_samples = sorted(mc_samples, key=lambda s: s["doc_id"])
    gen_samples = sorted(gen_samples, key=lambda s: s["doc_id"])
    lls = [[float(r[0][0]) for r in s["resps"]] for s in mc_samples]
    greedy = [[r[0][1] == "True" for r in s["resps"]] for s in mc_samples]
    hf_mc = hf["mc"][:len(mc_samples)]
    same_args = all(a["arg_0"] == h["context"] and a["arg_1"] == " " + c
                    for s, h in zip(mc_samples, hf_mc)
                    for a, c in zip(s["arguments"].values(), h["choices"]))
    diffs = [abs(a - b) for s, h in zip(lls, hf_mc) for a, b in zip(s, h["ll"])]
    texts = [s["resps"][0][0] for s in gen_samples]
    hf_gen = hf["gen"][:len(gen_samples)]
    hf_em = [last_number(h["text"]) == h["target"] for h in hf_gen]
    return {
        "minillm_via_lm_eval": {MC_TASK: {k: mc_res[f"{k},none"] for k in ("acc", "acc_norm")},
                                GEN_TASK: {"exact_match": gen_res["exact_match,last_number"]}},
        "hf_transformers": {MC_TASK: mc_metrics([h["ll"] for h in hf_mc],
                                                [h["choices"] for h in hf_mc],
                                                [h["answer"] for h in hf_mc]),
                            GEN_TASK: {"exact_match": sum(hf_em) / len(hf_em)}},
        "items": {"mc_questions": len(mc_samples), "mc_choices": len(diffs),
                  "mc_same_requests": same_args,
                  "mc_max_abs_loglikelihood_diff": max(diffs),
                  "mc_greedy_flags_equal": sum(g == h for s, hh in zip(greedy, hf_mc)
                                               for g, h in zip(s, hh["greedy"])),
                  "gen_questions": len(texts),
                  "gen_texts_equal": sum(t == h["text"] for t, h in zip(texts, hf_gen)),
                  "gen_differing": [{"minillm": t, "hf": h["text"]} for t, h in zip(texts, hf_gen)
                                    if t != h["text"]]},
    }


def print_table(report: dict) -> None:
    ours, ref, items = report["minillm_via_lm_eval"], report["hf_transformers"], report["items"]
    print(f"\n{'task':<20} {'metric':<12} {'minillm serve (lm-eval)':>24} {'HF transformers':>16}")
    for task in (MC_TASK, GEN_TASK):
        for metric, value in ours[task].items():
            print(f"{task:<20} {metric:<12} {value:>24.4f} {ref[task][metric]:>16.4f}")
    print(f"\nlog-likelihoods: {items['mc_choices']} choices of {items['mc_questions']} questions, "
          f"max |minillm - HF| = {items['mc_max_abs_loglikelihood_diff']:.2e}, same requests: "
          f"{items['mc_same_requests']}, greedy flags equal {items['mc_greedy_flags_equal']}/"
          f"{items['mc_choices']}")
    print(f"generations: {items['gen_texts_equal']}/{items['gen_questions']} texts identical")


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.bench.lm_eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="only the first N documents per task")
    ap.add_argument("--num-concurrent", type=int, default=4,
                    help="requests lm-eval keeps in flight (the server batches them)")
    ap.add_argument("--timeout-s", type=float, default=900.0,
                    help="bound on the server's start and on each lm-eval run")
    ap.add_argument("--json", default=str(ROOT / "figures" / "lm_eval.json"))
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit must be at least 1 (got {args.limit})")
    from ..models import ensure_smollm2_cache

    # SIGTERM/SIGHUP exit through the ``finally``s, as Ctrl-C does: the server and lm-eval are
    # stopped, not orphaned (the default handlers end the process on the spot)
    for sig in {signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)}:
        signal.signal(sig, stop_on_signal)
    model_dir = ensure_smollm2_cache()
    py = ensure_venv()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minillm-lmeval-") as work:
        runs = lm_eval_runs(py, model_dir, args.limit, args.num_concurrent, args.timeout_s,
                            Path(work))
    t1 = time.perf_counter()
    hf = hf_scores(model_dir, args.limit)         # after the server stopped: the cores are free
    report = {**compare(runs, hf), "model": MODEL, "dtype": "float32", "limit": args.limit,
              "lm_eval": LM_EVAL, "served_s": round(t1 - t0, 1),
              "hf_s": round(time.perf_counter() - t1, 1),
              "command": "python -m minillm.bench.lm_eval"
                         + (f" --limit {args.limit}" if args.limit else "")}
    print_table(report)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
