"""How often a truncated-layer draft's guess is kept, per position, under three rules (notebook 06;
docs/rungs/06_speculative.md's numbers for the seed promise's price):

    python -m minillm.bench.spec_coupling --temperature 1.0

  leviathan  sum(min(p, q)): min(1, p/q) rejection sampling (unseeded requests; the most any rule
             can keep)
  invcdf     P(sample_one(p, u) == sample_one(q, u)) with u shared: the seeded rule
             (``accept_seeded``), whose target draw is plain decoding's
  gumbel     P(argmax(log p + g) == argmax(log q + g)) with shared Gumbel noise g (not built: it
             would change how plain decoding draws every seeded sample)

Target: SmolLM2's 30 layers; draft: its first L layers + final norm + head (``DraftModelProposer``),
over sampled continuations of 4 chat and 2 copy requests, 40 tokens each.
"""
from __future__ import annotations

import argparse
import json

import torch

from ..models import load_model
from ..request import SamplingParams
from ..sampling import filtered_probs
from ..workload import make_copy_workload, make_workload


def invcdf_agree(lp: torch.Tensor, lq: torch.Tensor, t: float) -> float:
    """The measure of uniforms u for which the two inverse-CDF draws pick the same token."""
    pp, pi = filtered_probs(lp.float(), t, 0, 1.0)
    qp, qi = filtered_probs(lq.float(), t, 0, 1.0)
    cp, cq = pp.cumsum(0), qp.cumsum(0)
    edges = torch.cat([torch.zeros(1), cp, cq]).clamp(0, 1).sort().values
    mids, lens = (edges[1:] + edges[:-1]) / 2, edges[1:] - edges[:-1]
    a = pi[torch.searchsorted(cp, mids).clamp(max=len(pi) - 1)]
    b = qi[torch.searchsorted(cq, mids).clamp(max=len(qi) - 1)]
    return float(lens[a == b].sum())


def gumbel_agree(lp: torch.Tensor, lq: torch.Tensor, t: float, n: int = 200) -> float:
    g = -torch.log(-torch.log(torch.rand(n, lp.shape[-1]).clamp(1e-12, 1 - 1e-7)))
    a = (torch.log_softmax(lp.float() / t, -1) + g).argmax(-1)
    b = (torch.log_softmax(lq.float() / t, -1) + g).argmax(-1)
    return float((a == b).float().mean())


def main(argv: list[str] | None = None) -> None:
    from ..llm import LLM
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--layers", default="7,15,27", help="draft depths to compare")
    args = ap.parse_args(argv)
    t, depths = args.temperature, [int(x) for x in args.layers.split(",")]
    torch.manual_seed(0)
    model = load_model("smollm2-135m-instruct")
    hf = model.hf_model
    items = (make_workload(4, seed=0, short=(40, 40), long=(40, 40))
             + make_copy_workload(2, seed=0, lengths=(40, 40)))
    llm = LLM(model, engine="paged")
    reqs = llm.make_requests([it.prompt for it in items], [
        SamplingParams(max_tokens=40, temperature=t, seed=i, ignore_eos=True) for i in range(len(items))])
    res = llm.run(reqs)
    out: dict[int, dict[str, list[float]]] = {}
    for r, o in zip(reqs, res.outputs):
        with torch.no_grad():
            h = hf(torch.tensor([r.prompt_token_ids + o.token_ids]), output_hidden_states=True)
        n0 = len(r.prompt_token_ids) - 1
        lp_all = h.logits[0, n0:n0 + len(o.token_ids)]
        for depth in depths:
            with torch.no_grad():
                lq_all = hf.lm_head(hf.model.norm(h.hidden_states[depth][0, n0:n0 + len(o.token_ids)]))
            d = out.setdefault(depth, {"leviathan": [], "invcdf": [], "gumbel": []})
            for lp, lq in zip(lp_all, lq_all):
                p, q = torch.softmax(lp.float() / t, -1), torch.softmax(lq.float() / t, -1)
                d["leviathan"].append(float(torch.minimum(p, q).sum()))
                d["invcdf"].append(invcdf_agree(lp, lq, t))
                d["gumbel"].append(gumbel_agree(lp, lq, t))
    for depth, d in out.items():
        print(json.dumps({"temperature": t, "draft_layers": depth, "positions": len(d["leviathan"]),
                          **{k: round(sum(v) / len(v), 3) for k, v in d.items()}}), flush=True)


if __name__ == "__main__":
    main()
