"""Draft policies for n-gram speculation, replayed exactly on the grounded workload without timing anything.

A greedy answer under speculation is plain decoding's answer, and a draft is kept exactly when it equals the
answer's next token. So one plain greedy run per prompt (bench/workloads/grounded/, as bench/grounded.py asks
it) says, for any proposer and draft-length rule, how many steps and forward rows speculation would take and
how many drafts it would keep. Printed, one JSON line per policy: steps, rows, steps without drafts, the
share of drafts kept, tokens a step, and a tokens/s estimate from a per-step cost of a + b * rows (ms; the
defaults fit the default model's C=1 serve figures on 2 EPYC cores: 3.6 + 1.1 a row).

    .venv/bin/python bench/ngram_replay.py                      # the default model, 256 tokens an answer
    .venv/bin/python bench/ngram_replay.py --answers /tmp/answers.json   # reuse the greedy answers
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from grounded import load_prompts

from serval.engine.speculation.ngram import NgramProposer


@dataclass(frozen=True)
class Policy:
    name: str
    min_n: int
    max_n: int
    max_drafts: int
    adaptive: bool  # Speculator's rule: start at min(4, max), x2 after all kept, /2 after a rejection
    fallback_drafts: int = 0  # with no n-gram of min_n or more: this many drafts from a 1-gram match


def greedy_answers(model: str | None, max_tokens: int) -> list[dict]:
    from serval import LLM, SamplingParams

    llm = LLM(model)
    answers = []
    for prompt in load_prompts():
        messages = [{"role": "user", "content": prompt}]
        [out] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        answers.append({"prompt_ids": out.prompt_token_ids, "output_ids": out.outputs[0].token_ids})
    llm.close()
    return answers


def replay(answers: list[dict], policy: Policy, step_ms: Callable[[int], float]) -> dict:
    lookup = NgramProposer(policy.min_n, policy.max_n).lookup
    fallback = NgramProposer(1, 1).lookup
    num_steps = num_rows = num_without = num_drafts = num_kept = 0
    elapsed_ms = 0.0
    for answer in answers:
        context, output = list(answer["prompt_ids"]), answer["output_ids"]
        context.append(output[0])  # the prefill's token: speculation starts after it
        done, length = 1, min(4, policy.max_drafts) if policy.adaptive else policy.max_drafts
        while done < len(output):
            room = min(length, len(output) - done - 1)  # the step's own token always comes
            drafts = lookup(context, room) if room > 0 else []
            if not drafts and policy.fallback_drafts and room > 0:
                drafts = fallback(context, min(policy.fallback_drafts, room))
            kept = 0
            while kept < len(drafts) and drafts[kept] == output[done + kept]:
                kept += 1
            context += output[done : done + kept + 1]
            done += kept + 1
            num_steps += 1
            num_rows += 1 + len(drafts)
            num_without += not drafts
            num_drafts += len(drafts)
            num_kept += kept
            elapsed_ms += step_ms(1 + len(drafts))
            if drafts and policy.adaptive:
                length = (
                    min(2 * len(drafts), policy.max_drafts)
                    if kept == len(drafts)
                    else max(len(drafts) // 2, 1)
                )
    num_tokens = sum(len(a["output_ids"]) - 1 for a in answers)
    return {
        "policy": policy.name, "steps": num_steps, "rows": num_rows, "steps_without_drafts": num_without,
        "acceptance_rate": round(num_kept / max(num_drafts, 1), 3),
        "tokens_per_step": round(num_tokens / num_steps, 2),
        "estimated_tokens_per_s": round(num_tokens / elapsed_ms * 1000, 1),
    }  # fmt: skip


POLICIES = [
    Policy("fixed 4, n-grams 2-4 (the old default)", 2, 4, 4, adaptive=False),
    Policy("fixed 8, n-grams 2-4", 2, 4, 8, adaptive=False),
    Policy("fixed 15, n-grams 2-4", 2, 4, 15, adaptive=False),
    Policy("fixed 4, n-grams 1-4", 1, 4, 4, adaptive=False),
    Policy("fixed 8, n-grams 1-4", 1, 4, 8, adaptive=False),
    Policy("fixed 4, n-grams 2-8", 2, 8, 4, adaptive=False),
    Policy("adaptive up to 4, n-grams 2-8 (the default)", 2, 8, 4, adaptive=True),
    Policy("adaptive up to 8, n-grams 2-8", 2, 8, 8, adaptive=True),
    Policy("adaptive up to 15, n-grams 2-8", 2, 8, 15, adaptive=True),
    Policy(
        "adaptive up to 15, n-grams 2-8, 1 draft from a 1-gram when none", 2, 8, 15, True, fallback_drafts=1
    ),
    Policy(
        "adaptive up to 15, n-grams 2-8, 2 drafts from a 1-gram when none", 2, 8, 15, True, fallback_drafts=2
    ),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--answers", help="a JSON file of greedy answers: read if it exists, else written")
    parser.add_argument("--step-ms", type=float, default=3.6, help="a step's cost besides its rows")
    parser.add_argument("--row-ms", type=float, default=1.1, help="each forward row's cost")
    args = parser.parse_args()
    if args.answers and os.path.exists(args.answers):
        with open(args.answers) as f:
            answers = json.load(f)
    else:
        answers = greedy_answers(args.model, args.max_tokens)
        if args.answers:
            with open(args.answers, "w") as f:
                json.dump(answers, f)
    for policy in POLICIES:
        print(json.dumps(replay(answers, policy, lambda rows: args.step_ms + args.row_ms * rows)), flush=True)


if __name__ == "__main__":
    main()
