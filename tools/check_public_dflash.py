"""Loads a dflash-tui drafter with z-lab's public DFlash implementation (PyPI `dflash`, class
`DFlashDraftModel`, on Hugging Face transformers) and decodes the prompts of a
`dflash-tui eval --json` report with it: greedy speculative decoding against the same target.
Prints one JSON object comparing its outputs and acceptance lengths with dflash-tui's.

usage: python3 check_public_dflash.py TARGET_DIR DRAFTER_DIR EVAL_JSON [--dtype f32|bf16] [--device cuda]
A drafter with sliding-window layers (layer_types, use_sliding_window, sliding_window) is
checked to load with each sliding layer windowed and causal, each full layer not; a mismatch is
a problem (exit 1).
needs: torch, transformers (5.17.0 seen working; dflash declares 5.15.0, whose wheel refuses the
       tokenizers 0.23.2 beside it), dflash==0.1.0
"""

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM
import dflash.model
from dflash.model import DFlashDraftModel, dflash_generate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("eval_json")
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-new-tokens", type=int, required=True)
    args = ap.parse_args()
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.device == "cpu":
        # its timing helper synchronises CUDA; on the CPU a plain clock does the same job
        dflash.model._cuda_time = time.perf_counter
    report = json.load(open(args.eval_json))
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    drafter, info = DFlashDraftModel.from_pretrained(
        args.drafter, dtype=dtype, output_loading_info=True
    )
    drafter = drafter.to(args.device).eval()
    problems = {k: v for k, v in info.items() if v}
    # sliding-window layers (layer_types / use_sliding_window / sliding_window, as Qwen3.6-27B's
    # drafter): the public code must give each sliding layer the config's window, causally
    written = json.load(open(f"{args.drafter}/config.json"))
    kinds = written.get("layer_types") or ["full_attention"] * len(drafter.layers)
    window = written.get("sliding_window") if written.get("use_sliding_window") else None
    layers = [
        {"sliding_window": getattr(l.self_attn, "sliding_window", None),
         "is_causal": bool(getattr(l.self_attn, "is_causal", False))}
        for l in drafter.layers
    ]
    for i, (kind, got) in enumerate(zip(kinds, layers)):
        want = (window, True) if kind == "sliding_attention" else (None, False)
        if (got["sliding_window"], got["is_causal"]) != want:
            problems.setdefault("attention_layout", []).append(
                f"layer {i} ({kind}): public sliding_window={got['sliding_window']} "
                f"is_causal={got['is_causal']}, config says window {want[0]}"
            )
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    # record the public model's drafted tokens at every step
    recorded, margins = [], []
    plain_logits = drafter.compute_logits

    def recording_logits(hidden, head):
        logits = plain_logits(hidden, head)
        recorded.append(torch.argmax(logits, dim=-1)[0].tolist())
        top2 = torch.topk(logits[0].float(), 2, dim=-1).values
        margins.append((top2[..., 0] - top2[..., 1]).tolist())
        return logits

    drafter.compute_logits = recording_logits
    same_output, same_accepts, same_drafts, draft_steps = 0, 0, 0, 0
    # drafts compared only where both decoders stood at the same position (every earlier step
    # accepted the same number of tokens); once acceptance differs, later drafts start elsewhere
    aligned_steps, aligned_same, aligned_tokens, aligned_tokens_same = 0, 0, 0, 0
    diff_margins, draft_diffs = [], []
    steps, accepted = 0, 0
    ours_steps, ours_accepted = 0, 0
    first_diffs = []
    with torch.no_grad():
        for i, p in enumerate(report["prompts"]):
            ids = torch.tensor([p["prompt_ids"]], device=args.device)
            recorded.clear()
            margins.clear()
            out = dflash_generate(
                drafter, target, ids, args.max_new_tokens, eos, return_stats=True
            )
            gen = out.output_ids[0, ids.shape[1]:].tolist()
            acc = list(out.acceptance_lengths)
            steps += len(acc)
            accepted += sum(acc)
            ours = p["accept_lengths"]
            ours_steps += len(ours)
            ours_accepted += sum(ours)
            if gen == p["output_ids"]:
                same_output += 1
            else:
                d = next((k for k, (a, b) in enumerate(zip(gen, p["output_ids"])) if a != b),
                         min(len(gen), len(p["output_ids"])))
                first_diffs.append((i, d))
            # the last step may differ: the public code shortens the final block to the limit
            if acc[:-1] == ours[: len(acc) - 1]:
                same_accepts += 1
            # drafts of the steps both made (the public code shortens its last block)
            for k, (theirs, mine) in enumerate(zip(recorded, p["drafts"])):
                draft_steps += 1
                same_drafts += theirs == mine[: len(theirs)]
                # (full blocks only: the public code drafts min(block, tokens left) positions
                # near the limit, and a block's positions attend to each other, so a shorter
                # block's drafts legitimately differ)
                full = len(theirs) == drafter.block_size - 1
                if acc[:k] == ours[:k] and full:
                    aligned_steps += 1
                    aligned_same += theirs == mine[: len(theirs)]
                    aligned_tokens += len(theirs)
                    aligned_tokens_same += sum(a == b for a, b in zip(theirs, mine))
                    # the public drafter's top-1/top-2 logit margin where the tokens differ
                    for j, (a, b, m) in enumerate(zip(theirs, mine, margins[k])):
                        if a != b:
                            diff_margins.append(m)
                            draft_diffs.append((i, k, j, round(m, 4)))
    print(json.dumps({
        "loading_info_problems": problems,
        "drafter_class": type(drafter).__name__,
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "layer_types": kinds,
        "public_layer_attention": layers,
        "prompts": len(report["prompts"]),
        "tau_public": accepted / max(steps, 1),
        "tau_dflash_tui": ours_accepted / max(ours_steps, 1),
        "identical_outputs": same_output,
        "identical_accept_lengths_before_last_step": same_accepts,
        "first_differences": first_diffs[:10],
        "draft_steps_compared": draft_steps,
        "identical_drafts": same_drafts,
        "draft_steps_at_the_same_position": aligned_steps,
        "identical_drafts_at_the_same_position": aligned_same,
        "drafted_tokens_at_the_same_position": aligned_tokens,
        "identical_drafted_tokens_at_the_same_position": aligned_tokens_same,
        "largest_logit_margin_where_drafted_tokens_differ": max(diff_margins, default=None),
        "drafted_token_differences": draft_diffs[:10],
    }))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
