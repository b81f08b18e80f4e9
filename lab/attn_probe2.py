# Probe (not product; `python3 lab/attn_probe2.py` on the GPU machine): the chunked training attention (cuDNN / memory-efficient with an
# additive mask) at the 8B shape, one layer fwd+bwd, for chunk sizes C, entries per call and
# the kernel libtorch picks or is told to use.
import math, sys, torch
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.manual_seed(0)
dev = "cuda"; dt = torch.bfloat16
H, KV, D, BS = 32, 8, 128, 16
S = [1530, 1490]; B = len(S); N = 512
anchors = []
for s in S:
    cand = torch.nonzero(torch.rand(s - BS + 1) < 0.6).flatten()
    anchors.append(cand[torch.randperm(len(cand))[:N]].sort().values.tolist())
ctxk = torch.randn(B, KV, max(S), D, device=dev, dtype=dt, requires_grad=True)
ctxv = torch.randn(B, KV, max(S), D, device=dev, dtype=dt, requires_grad=True)
def bucket(s):
    p = 1 << (s.bit_length() - 1); step = max(p // 16, 128)
    return (s + step - 1) // step * step
def timeit(fn, n=8):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n
def setup(CPC, CALL):
    entries = []
    for k in range(max(math.ceil(len(a) / CPC) for a in anchors)):
        for r, a in enumerate(anchors):
            if k * CPC < len(a): entries.append((r, a[k * CPC:(k + 1) * CPC]))
    while len(entries) % CALL: entries.append((0, []))
    R = CPC * BS; calls = []
    for c in range(0, len(entries), CALL):
        es = entries[c:c + CALL]
        last = max([max(a) if a else 0 for (_, a) in es] + [1])
        ctx = min(bucket(last), max(S))
        qa = torch.zeros(CALL, R, dtype=torch.long)
        for i, (_, a) in enumerate(es):
            for t, an in enumerate(a): qa[i, t * BS:(t + 1) * BS] = an
        qa = qa.to(dev)
        sees_ctx = torch.arange(ctx, device=dev)[None, None, :] < qa[:, :, None]
        blk = torch.arange(R, device=dev) // BS
        m = torch.cat([sees_ctx, (blk[:, None] == blk[None, :]).expand(CALL, R, R)], -1)
        keys = ctx + R; padded = (keys + 15) // 16 * 16
        bias = torch.zeros(CALL, 1, R, padded, device=dev, dtype=dt)[..., :keys].masked_fill(~m[:, None], -float("inf"))
        calls.append((ctx, torch.tensor([r for (r, _) in es], device=dev), bias))
    qc = torch.randn(len(entries), H, R, D, device=dev, dtype=dt, requires_grad=True)
    kc = torch.randn(len(entries), KV, R, D, device=dev, dtype=dt, requires_grad=True)
    vc = torch.randn(len(entries), KV, R, D, device=dev, dtype=dt, requires_grad=True)
    pairs = sum(c[0] + R for c in calls) * CALL * R
    return calls, qc, kc, vc, pairs
def run(calls, qc, kc, vc, CALL, expand):
    outs = []
    for i, (ctx, seqs, bias) in enumerate(calls):
        sl = slice(i * CALL, (i + 1) * CALL)
        k = torch.cat([ctxk[:, :, :ctx].index_select(0, seqs), kc[sl]], 2)
        v = torch.cat([ctxv[:, :, :ctx].index_select(0, seqs), vc[sl]], 2)
        if expand:
            k = k.repeat_interleave(H // KV, 1); v = v.repeat_interleave(H // KV, 1)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qc[sl], k, v, attn_mask=bias, enable_gqa=not expand))
    out = torch.cat(outs)
    out.backward(torch.ones_like(out))
for CPC, CALL in [(32, 8), (32, 16), (32, 32), (64, 8), (64, 16), (16, 16), (16, 32), (128, 4), (128, 8)]:
    calls, qc, kc, vc, pairs = setup(CPC, CALL)
    res = []
    for name, backs, expand in [("auto", None, False), ("cudnn", [SDPBackend.CUDNN_ATTENTION], False), ("effx", [SDPBackend.EFFICIENT_ATTENTION], True)]:
        try:
            if backs is None:
                t = timeit(lambda: run(calls, qc, kc, vc, CALL, expand))
            else:
                with sdpa_kernel(backs):
                    t = timeit(lambda: run(calls, qc, kc, vc, CALL, expand))
            res.append("%s %.3f" % (name, t))
        except Exception as e:
            res.append("%s err %s" % (name, str(e)[:60]))
    print("C %d per call %d pairs %.2e calls %d: %s" % (CPC, CALL, pairs, len(calls), "  ".join(res)), flush=True)
