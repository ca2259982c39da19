"""How close a peer server's next-token distributions are to serval's dense fp32 on the same GGUF, beside
serval's own compared path, measured the same way: teacher-forced on the engine test prompts and fp32's greedy
answers (bench/fidelity.py), the peer asked one position at a time through its native /completion endpoint
(llama-server: `n_predict` 1, `n_probs` K, the prompt as token ids, its cache reused from the last request).

A peer returns only its top K tokens, so the divergence here is over those: KL(fp32 || compared) summed over
fp32's top K tokens, a token missing from the compared top K taken at the compared K-th log-probability (an
upper bound on its own, so each such term is a lower bound). serval's compared path goes through the same
truncation, so the two figures are comparable with each other, not with bench/fidelity.py's full-vocabulary KL.

    LD_LIBRARY_PATH=$B $B/llama-server -m MODEL.gguf --host 127.0.0.1 --port 8080 -np 1 -c 4096 &
    .venv/bin/python bench/peer_fidelity.py --peer http://127.0.0.1:8080 [--model MODEL.gguf] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import httpx
import torch

from serval import LLM, SamplingParams

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # for the shared prompts
from tests.fixtures.fidelity import fp32_reference, teacher_forced_log_probs
from tests.fixtures.prompts import PROMPTS


def peer_top_log_probs(peer: str, context: list[int], k: int) -> dict[int, float]:
    """The peer's top k next-token log-probabilities after `context`, before any sampling."""
    body = {
        "prompt": context,
        "n_predict": 1,
        "n_probs": k,
        "temperature": 0.0,
        "cache_prompt": True,
        "post_sampling_probs": False,
    }
    reply = httpx.post(f"{peer}/completion", json=body, timeout=120)
    reply.raise_for_status()
    position = reply.json()["completion_probabilities"][0]
    return {int(t["id"]): float(t["logprob"]) for t in position["top_logprobs"]}


def top_of(log_probs: torch.Tensor, k: int) -> dict[int, float]:
    values, ids = log_probs.topk(k)
    return dict(zip(ids.tolist(), values.tolist()))


def truncated_kl(reference: dict[int, float], compared: dict[int, float]) -> float:
    floor = min(compared.values())
    return sum(math.exp(p) * (p - compared.get(token, floor)) for token, p in reference.items())


def summary(kls: list[float], agreements: list[bool]) -> dict:
    kl = torch.tensor(kls)
    return {
        "positions": len(kls),
        "top_k_kl_mean": round(float(kl.mean()), 6),
        "top_k_kl_p99": round(float(kl.quantile(0.99)), 6),
        "top_k_kl_max": round(float(kl.max()), 6),
        "top_token_agreement": round(sum(agreements) / len(agreements), 6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", required=True, help="the peer's base URL (llama-server), on loopback")
    parser.add_argument("--peer-label", default="llama-server")
    parser.add_argument("--model", default=None, help="the GGUF both serve (default: serval's default model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--dtype", default="auto", help="serval's compared path")
    parser.add_argument("--batch-activations", default="int8")
    args = parser.parse_args()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts, answers, reference = fp32_reference(args.model, PROMPTS, params)
    compared_llm = LLM(args.model, dtype=args.dtype, batch_activations=args.batch_activations)
    compared = teacher_forced_log_probs(compared_llm, prompts, answers)

    ours = {"kl": [], "agree": []}
    peers = {"kl": [], "agree": []}
    for prompt, answer, ref_rows, our_rows in zip(prompts, answers, reference, compared):
        for position, (ref_row, our_row) in enumerate(zip(ref_rows, our_rows)):
            ref_top = top_of(ref_row, args.top_k)
            best = max(ref_top, key=ref_top.get)
            our_top = top_of(our_row, args.top_k)
            peer_top = peer_top_log_probs(args.peer, prompt + answer[:position], args.top_k)
            for tally, top in ((ours, our_top), (peers, peer_top)):
                tally["kl"].append(truncated_kl(ref_top, top))
                # bf16 logits tie often: agreement is fp32's top token being among the compared path's best
                tally["agree"].append(top.get(best, -math.inf) == max(top.values()))
    label = f"serval --dtype {args.dtype} --batch-activations {args.batch_activations}"
    for name, tally in ((label, ours), (args.peer_label, peers)):
        print(
            json.dumps(
                {
                    "against": "serval dense fp32",
                    "compared": name,
                    "top_k": args.top_k,
                    **summary(tally["kl"], tally["agree"]),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
