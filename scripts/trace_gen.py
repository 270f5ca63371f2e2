"""Generates prefix-cache traces in the format of ../shared/data (JSON lines with `hash_ids`, one
request per line, 512 tokens a block), with shapes other than the FAST'25 file, so that eviction
and admission are not tuned to one trace. A request is a conversation's next turn: the shared
system prompt it starts with, the conversation's own context (a document), every earlier turn, and
the new turn's blocks. Which conversation speaks next follows a Zipf popularity (`--skew`; 0 is
uniform); conversations end after a geometric number of turns (`--mean-turns`) and new ones start.

    python3 scripts/trace_gen.py --shape chat --requests 4000 --seed 1 > chat.jsonl
    python3 scripts/trace_gen.py --requests 4000 --system-prompts 4 --skew 1.2 --doc-len 40 > rag.jsonl

Shapes (defaults that flags override): chat (deep conversations, short shared prompts), rag (few
popular documents shared by many short conversations), agent (one long shared prefix, many
turns), flat (no sharing beyond a conversation, uniform popularity).
"""

import argparse
import json
import random
import sys

SHAPES = {
    "chat": dict(conversations=1500, system_prompts=8, system_len=4, doc_len=0, turn_len=8, mean_turns=8,
                 skew=0.6),
    "rag": dict(conversations=1500, system_prompts=600, system_len=32, doc_len=0, turn_len=3, mean_turns=2,
                skew=0.9),
    "agent": dict(conversations=600, system_prompts=2, system_len=40, doc_len=8, turn_len=8, mean_turns=20,
                  skew=0.3),
    "flat": dict(conversations=800, system_prompts=1, system_len=0, doc_len=12, turn_len=4, mean_turns=4, skew=0.0),
}


class Zipf:
    """Indices 0..n-1 drawn with weight 1 / (i + 1) ** skew."""

    def __init__(self, n, skew, rng):
        self.rng = rng
        weights = [1.0 / (i + 1) ** skew for i in range(n)]
        total = sum(weights)
        acc, self.cdf = 0.0, []
        for w in weights:
            acc += w / total
            self.cdf.append(acc)

    def draw(self):
        import bisect
        return min(bisect.bisect_left(self.cdf, self.rng.random()), len(self.cdf) - 1)


def generate(args, out):
    rng = random.Random(args.seed)
    next_id = iter(range(1, 1 << 62))
    prompts = [[next(next_id) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    prompt_pick = Zipf(len(prompts), args.skew, rng)
    slot_pick = Zipf(args.conversations, args.skew, rng)

    def new_conversation():
        prefix = list(prompts[prompt_pick.draw()])
        prefix += [next(next_id) for _ in range(args.doc_len)]
        return {"blocks": prefix, "left": 1 + int(rng.expovariate(1.0 / max(args.mean_turns - 1, 1e-9)))}

    slots = [new_conversation() for _ in range(args.conversations)]
    for t in range(args.requests):
        i = slot_pick.draw()
        conv = slots[i]
        turn = [next(next_id) for _ in range(max(1, int(rng.expovariate(1.0 / args.turn_len)) + 1))]
        conv["blocks"] = conv["blocks"] + turn
        ids = conv["blocks"][: args.max_blocks]
        out.write(json.dumps({"timestamp": t, "input_length": 512 * len(ids), "output_length": 0,
                              "hash_ids": ids}) + "\n")
        conv["left"] -= 1
        if conv["left"] <= 0:
            slots[i] = new_conversation()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="chat")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-blocks", type=int, default=400, help="longest request, in blocks")
    for name in SHAPES["chat"]:
        ap.add_argument("--" + name.replace("_", "-"), type=type(SHAPES["chat"][name]), default=None)
    args = ap.parse_args()
    for name, value in SHAPES[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.requests < 1 or args.conversations < 1 or args.system_prompts < 1 or args.turn_len <= 0:
        sys.exit("--requests, --conversations, --system-prompts and --turn-len must be positive")
    generate(args, sys.stdout)


if __name__ == "__main__":
    main()
