"""Writes configs/shapes/qwen3.5-27b/config.json and configs/shapes/qwen3.5-4b/config.json: the
config.json that transformers' `save_pretrained` writes for a `Qwen3_5ForConditionalGeneration`
of each shape (text settings under `text_config`, a vision tower's settings under
`vision_config` that a text trainer never reads), bf16. Shapes for benchmarks with random
weights (`model.random_weights = true`); no weights are made.

- qwen3.5-27b: the Qwen3.5-27B / Qwen3.6-27B text model (64 layers, hidden 5120, ffn 17408,
  24 heads / 4 kv of 256, partial rotary 0.25, theta 1e7, vocab 248320, Gated DeltaNet 48 value /
  16 key heads of 128, conv 4, a full-attention layer every 4th, untied embeddings), as
  /work/shared/anchors/qwen35_hf_forward.py builds it for the measured transformers forward.
- qwen3.5-4b: our reading of the public Qwen3.5-4B (32 layers, hidden 2560, ffn 9216, 16 heads /
  4 kv of 256, GDN 32 value / 16 key heads of 128, tied embeddings).

Run from the repository root (made with transformers 5.23.0):
    PYTHONPATH=/path/to/transformers python3 configs/shapes/make_qwen35_shapes.py
"""
import json
import os
import tempfile

from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

COMMON = dict(
    vocab_size=248320, head_dim=256, num_key_value_heads=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_conv_kernel_dim=4,
    full_attention_interval=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
SHAPES = {
    "qwen3.5-27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, linear_num_value_heads=48,
                        tie_word_embeddings=False),
    "qwen3.5-4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                       num_attention_heads=16, linear_num_value_heads=32,
                       tie_word_embeddings=True),
}

for name, shape in SHAPES.items():
    text = dict(COMMON, **shape)
    # The vision tower is transformers' default, its output sized to the text model's input.
    vision = {"out_hidden_size": shape["hidden_size"]}
    config = Qwen3_5Config(text_config=text, vision_config=vision,
                           tie_word_embeddings=shape["tie_word_embeddings"])
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.dtype = "bfloat16"
    config.text_config.dtype = "bfloat16"
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
