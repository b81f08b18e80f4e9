"""Writes configs/shapes/qwen3.5-35b-a3b/config.json and configs/shapes/qwen3-30b-a3b/config.json:
the config.json that transformers' `save_pretrained` writes for each mixture-of-experts shape,
bf16. Shapes for benchmarks with random weights (`model.random_weights = true`); no weights are
made.

- qwen3.5-35b-a3b: a `Qwen3_5MoeForConditionalGeneration` of the Qwen3.5-35B-A3B / Qwen3.6-35B-A3B
  text shape as /work/shared/anchors/qwen35_moe_hf_forward.py builds it for the measured
  transformers forward (40 layers, hidden 2048, 256 experts with 8 active plus a shared expert,
  expert ffn 512, 16 heads / 2 kv of 256, GDN 32 value / 16 key heads of 128, vocab 248320,
  untied).
- qwen3-30b-a3b: a `Qwen3MoeForCausalLM` of the Qwen3-30B-A3B shape (48 layers, hidden 2048,
  128 experts with 8 active, expert ffn 768, 32 heads / 4 kv of 128, vocab 151936, untied).

Run from the repository root (made with transformers 5.23.0):
    PYTHONPATH=/path/to/transformers python3 configs/shapes/make_moe_shapes.py
"""
import json
import os
import tempfile

from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig


def qwen35_moe():
    text = dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_value_heads=32, linear_num_key_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, full_attention_interval=4, rms_norm_eps=1e-6,
        max_position_embeddings=262144, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    config = Qwen3_5MoeConfig(text_config=text, vision_config={"out_hidden_size": 2048},
                              tie_word_embeddings=False)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    config.text_config.dtype = "bfloat16"
    return config


def qwen3_moe():
    config = Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


for name, make in (("qwen3.5-35b-a3b", qwen35_moe), ("qwen3-30b-a3b", qwen3_moe)):
    config = make()
    config.dtype = "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            saved = json.load(f)
    out = os.path.join("configs", "shapes", name, "config.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
        f.write("\n")
    print(out)
