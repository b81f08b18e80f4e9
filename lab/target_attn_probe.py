"""The target's causal attention at the 8B shape (32 query heads, 8 key/value heads, head 128,
bf16) in each of libtorch's kernels: flash (what `attention` calls directly today) against
cuDNN's, the time of a call and of the first call at a new length (cuDNN plans per shape).
  python3 lab/target_attn_probe.py"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


for batch, length in [(2, 1536), (2, 1500), (1, 3072), (2, 2048)]:
    q = torch.randn(batch, 32, length, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    row = [f"{batch} x {length}:"]
    for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
        with sdpa_kernel(backend):
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                torch.cuda.synchronize()
                first = (time.perf_counter() - t0) * 1e3
                ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
                row.append(f"{name} {ms * 1e3:.1f} us (first call {first:.1f} ms)")
            except RuntimeError as e:
                row.append(f"{name} refused ({str(e).splitlines()[0][:80]})")
    # cuDNN without GQA (keys and values expanded to the query heads)
    ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = timed(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True))
    row.append(f"cudnn expanded {ms * 1e3:.1f} us")
    print(" ".join(row), flush=True)
