"""Compares two `dflash-tui eval --json` reports prompt by prompt: tau of each over the prompts
they share (the same prompt ids, in order), and the difference with its 95 % interval paired
by prompt. Two drafters (or two dtypes) on the same prompts vary together from prompt to prompt,
so the paired interval of their difference is much narrower than either report's own interval.

usage: python3 eval_compare.py A.json B.json [--first N]       (either may be .json.xz, as a
       lab/recipe-state.sh save keeps them)

--first N: only the first N prompts (e.g. the 100 of an earlier 100-prompt eval inside a
170-prompt one). Prompts whose outputs are identical in both runs are also compared alone:
there the two decoded the same text, so only the drafting differed.
"""

import argparse
import json
import lzma
import math
import sys


def per_prompt(path):
    try:
        opener = lzma.open if path.endswith(".xz") else open
        with opener(path, "rt") as f:
            prompts = json.load(f)["prompts"]
    except (OSError, ValueError, KeyError, lzma.LZMAError) as e:
        sys.exit(f"{path}: not an eval --json report: {e}")
    return prompts


def tau(rows):
    # (accepted, steps) per prompt -> tau = sum(accepted) / sum(steps)
    steps = sum(s for _, s in rows)
    return sum(a for a, _ in rows) / steps if steps else float("nan")


def residuals(rows):
    # the linearised ratio estimator: prompt i adds (a_i - tau * s_i) / mean(s)
    t = tau(rows)
    mean_steps = sum(s for _, s in rows) / len(rows)
    return [(a - t * s) / mean_steps for a, s in rows]


def interval(diffs):
    n = len(diffs)
    if n < 2:
        return None
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return 1.96 * math.sqrt(var / n)


def compare(name, a_rows, b_rows):
    ta, tb = tau(a_rows), tau(b_rows)
    half = interval([x - y for x, y in zip(residuals(a_rows), residuals(b_rows))])
    ci = f"{ta - tb - half:+.3f} to {ta - tb + half:+.3f}" if half is not None else "n/a"
    print(f"{name}: {len(a_rows)} prompts, tau A {ta:.3f}, B {tb:.3f}, A - B {ta - tb:+.3f} "
          f"(95 % paired interval {ci})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--first", type=int, default=None)
    args = p.parse_args()
    a, b = per_prompt(args.a), per_prompt(args.b)
    n = min(len(a), len(b), args.first or len(a))
    for i in range(n):
        if a[i]["prompt_ids"] != b[i]["prompt_ids"]:
            sys.exit(f"prompt {i} differs between {args.a} and {args.b}: not the same prompt set")
    rows = lambda ps: [(sum(p["accept_lengths"]), len(p["accept_lengths"])) for p in ps]
    compare("all shared", rows(a[:n]), rows(b[:n]))
    same = [i for i in range(n) if a[i]["output_ids"] == b[i]["output_ids"]]
    if same:
        compare("identical outputs", rows([a[i] for i in same]), rows([b[i] for i in same]))
    else:
        print("identical outputs: none")


if __name__ == "__main__":
    main()
