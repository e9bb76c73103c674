"""Two lm-evaluation-harness runs of the same task side by side, item by item: what
``python -m minillm.bench.lm_eval`` reports (``minillm serve`` through ``local-completions`` /
``local-chat-completions`` against Hugging Face through lm-eval's own ``--model hf``).

Pure functions over lm-eval's output directory (``--output_path`` with ``--log_samples``): a
``results_*.json`` with the aggregate metrics and a ``samples_<task>_*.jsonl`` with one line per
document. lm-eval writes each response with ``str()`` (``sanitize_list``): a log-likelihood
request's response is ``["-3.14", "False"]`` (the continuation's log-likelihood, whether greedy
decoding produces it), a generation's is the text.
"""
from __future__ import annotations

import json
from pathlib import Path

# the metrics each task reports (``<metric>,<filter>`` in lm-eval's results)
METRICS = {"multiple_choice": {"acc": "acc,none", "acc_norm": "acc_norm,none"},
           "generate_until": {"exact_match": "exact_match,last_number"}}


def read_output(out: Path, task: str) -> tuple[dict, list[dict]]:
    """One lm-eval run's results for ``task`` and its samples in document order."""
    results = next(out.glob("**/results_*.json"), None)
    samples = next(out.glob(f"**/samples_{task}_*.jsonl"), None)
    if results is None or samples is None:
        raise FileNotFoundError(f"no results_*.json and samples_{task}_*.jsonl under {out}")
    lines = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return json.loads(results.read_text())["results"][task], sorted(lines,
                                                                     key=lambda s: s["doc_id"])


def choice_scores(sample: dict) -> list[tuple[float, bool]]:
    """A multiple-choice sample's (log-likelihood, greedy) per choice, in the choices' order."""
    return [(float(r[0][0]), str(r[0][1]) == "True") for r in sample["resps"]]


def requests(sample: dict) -> list[tuple[str, str]]:
    """A multiple-choice sample's (context, continuation) per choice: what lm-eval asked."""
    return [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]


def metrics(results: dict, kind: str) -> dict:
    return {name: results[key] for name, key in METRICS[kind].items()}


def compare_mc(ours: list[dict], ref: list[dict]) -> dict:
    """Per choice: the same request, log-likelihoods apart by how much, greedy flags agreeing;
    per question: the same choice picked (``acc``'s argmax)."""
    if [s["doc_id"] for s in ours] != [s["doc_id"] for s in ref]:
        raise ValueError("the two runs scored different documents")
    pairs = [(a, b) for s, r in zip(ours, ref) for a, b in zip(choice_scores(s), choice_scores(r))]

    def pick(sample):
        lls = [ll for ll, _ in choice_scores(sample)]
        return lls.index(max(lls))
    return {"mc_questions": len(ours), "mc_choices": len(pairs),
            "mc_same_requests": all(requests(s) == requests(r) for s, r in zip(ours, ref)),
            "mc_max_abs_loglikelihood_diff": max(abs(a[0] - b[0]) for a, b in pairs),
            "mc_greedy_flags_equal": sum(a[1] == b[1] for a, b in pairs),
            "mc_same_pick": sum(pick(s) == pick(r) for s, r in zip(ours, ref))}


def compare_gen(ours: list[dict], ref: list[dict]) -> dict:
    """Per question: the generated texts (after the stop sequences), identical or not."""
    if [s["doc_id"] for s in ours] != [s["doc_id"] for s in ref]:
        raise ValueError("the two runs scored different documents")
    texts = [(s["resps"][0][0], r["resps"][0][0]) for s, r in zip(ours, ref)]
    return {"gen_questions": len(texts), "gen_texts_equal": sum(a == b for a, b in texts),
            "gen_differing": [{"doc_id": s["doc_id"], "minillm": a, "hf": b}
                              for s, (a, b) in zip(ours, texts) if a != b]}


def compare(ours: dict, ref: dict, tasks: dict) -> dict:
    """``ours`` and ``ref``: task -> (results, samples) of each side; ``tasks``: task -> its
    ``output_type``. Both sides' metrics, and the items compared."""
    items: dict = {}
    for task, kind in tasks.items():
        items.update((compare_mc if kind == "multiple_choice" else compare_gen)(
            ours[task][1], ref[task][1]))
    return {"minillm_via_lm_eval": {t: metrics(ours[t][0], k) for t, k in tasks.items()},
            "hf_via_lm_eval": {t: metrics(ref[t][0], k) for t, k in tasks.items()},
            "items": items}


def print_table(report: dict) -> None:
    ours, ref, items = report["minillm_via_lm_eval"], report["hf_via_lm_eval"], report["items"]
    print(f"\n{'task':<20} {'metric':<12} {'minillm serve (local-*)':>24} {'--model hf':>12}")
    for task, values in ours.items():
        for metric, value in values.items():
            print(f"{task:<20} {metric:<12} {value:>24.4f} {ref[task][metric]:>12.4f}")
    print(f"\nlog-likelihoods: {items['mc_choices']} choices of {items['mc_questions']} questions, "
          f"max |minillm - HF| = {items['mc_max_abs_loglikelihood_diff']:.2e}, same requests: "
          f"{items['mc_same_requests']}, greedy flags equal {items['mc_greedy_flags_equal']}/"
          f"{items['mc_choices']}, same pick {items['mc_same_pick']}/{items['mc_questions']}")
    print(f"generations: {items['gen_texts_equal']}/{items['gen_questions']} texts identical")
