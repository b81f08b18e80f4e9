# Probe (not product; `python3 lab/attn_probe.py [W]` on the GPU machine): the drafter's chunked training attention at the 8B shape, one layer,
# forward + backward: (a) today's cuDNN-with-bias chunk calls, (b) flash varlen over each chunk's
# context prefix + flash varlen over each block's rest (GQA-folded), merged by LSE, backward by
# flash's backward with the merged output and LSE. Checks (b) against a dense reference.
import math, sys, torch, time
torch.manual_seed(0)
dev = "cuda"
dt = torch.bfloat16
H, KV, D, BS = 32, 8, 128, 16
G = H // KV
S = [1530, 1490]
B = len(S)
N = 512
CPC = 32
CALL = 8

anchors = []
for s in S:
    cand = torch.nonzero(torch.rand(s - BS + 1) < 0.6).flatten()
    pick = cand[torch.randperm(len(cand))[:N]].sort().values
    anchors.append(pick.tolist())
M = sum(len(a) for a in anchors)
print("blocks", M, "per row", [len(a) for a in anchors])

ctxk = torch.randn(B, max(S), KV, D, device=dev, dtype=dt)
ctxv = torch.randn(B, max(S), KV, D, device=dev, dtype=dt)
q = torch.randn(M * BS, H, D, device=dev, dtype=dt)
bk = torch.randn(M * BS, KV, D, device=dev, dtype=dt)
bv = torch.randn(M * BS, KV, D, device=dev, dtype=dt)
dout = torch.randn(M * BS, H, D, device=dev, dtype=dt)
scale = 1 / math.sqrt(D)

def timeit(fn, n=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n

# ---- (b) split: chunks of consecutive blocks, at most CPC blocks and span <= W
W = int(sys.argv[1]) if len(sys.argv) > 1 else 48
chunks = []  # (row, first block index (global), count, a_first)
gi = 0
for r, a in enumerate(anchors):
    j = 0
    while j < len(a):
        k = j
        while k + 1 < len(a) and k + 1 - j < CPC and a[k + 1] - a[j] <= W:
            k += 1
        chunks.append((r, gi + j, k - j + 1, a[j]))
        j = k + 1
    gi += len(a)
print("chunks", len(chunks), "W", W)
stride = max(S)
flat_idx = []  # part-1 keys: per chunk the rows r*stride + [0, a_first)
cu_q1 = [0]; cu_k1 = [0]
for (r, g0, n, af) in chunks:
    flat_idx.extend(range(r * stride, r * stride + af))
    cu_q1.append(cu_q1[-1] + n * BS)
    cu_k1.append(cu_k1[-1] + af)
idx1 = torch.tensor(flat_idx, device=dev, dtype=torch.long)
cu_q1 = torch.tensor(cu_q1, device=dev, dtype=torch.int32)
cu_k1t = torch.tensor(cu_k1, device=dev, dtype=torch.int32)
max_q1 = max(n for (_, _, n, _) in chunks) * BS
max_k1 = max(af for (_, _, _, af) in chunks)
print("part-1 key rows", len(flat_idx), "max_k", max_k1)
# part 2: per (block, kv head): 16*G query rows, keys [a_first, a_j) from the context, then own 16
idx2 = []  # rows of cat([ctx flat (B*stride), block (M*BS)])
cu_k2 = [0]
lens2 = []
for (r, g0, n, af) in chunks:
    for t in range(n):
        j = g0 + t
        aj = anchors[r][j - sum(len(x) for x in anchors[:r])]
        rows = list(range(r * stride + af, r * stride + aj)) + [B * stride + j * BS + u for u in range(BS)]
        idx2.append(rows)
        lens2.append(len(rows))
Lmax2 = max(lens2)
print("part-2 keys per block: mean", sum(lens2) / len(lens2), "max", Lmax2)
# keys laid out [M, KV, len_j, D] -> flat rows ((j, h) sequences); index into [(B*stride+M*BS)*KV] rows
seq_rows = []
cu2 = [0]
for j, rows in enumerate(idx2):
    for h in range(KV):
        seq_rows.extend([rr * KV + h for rr in rows])
        cu2.append(cu2[-1] + len(rows))
idx2t = torch.tensor(seq_rows, device=dev, dtype=torch.long)
cu_k2 = torch.tensor(cu2, device=dev, dtype=torch.int32)
cu_q2 = torch.arange(0, M * KV + 1, device=dev, dtype=torch.int32) * (BS * G)

fa = torch.ops.aten._flash_attention_forward
fb = torch.ops.aten._flash_attention_backward

def split_forward_backward(check=False):
    k_all = torch.cat([ctxk.reshape(B * stride, KV, D), bk])
    v_all = torch.cat([ctxv.reshape(B * stride, KV, D), bv])
    ck = ctxk.reshape(B * stride, KV, D)
    cv = ctxv.reshape(B * stride, KV, D)
    k1 = ck.index_select(0, idx1); v1 = cv.index_select(0, idx1)
    o1, l1, seed, off, _ = fa(q, k1, v1, cu_q1, cu_k1t, max_q1, max_k1, 0.0, False, False)
    # GQA-folded queries: [M, BS, KV, G, D] -> [M, KV, G, BS, D] -> rows
    q2 = q.view(M, BS, KV, G, D).permute(0, 2, 3, 1, 4).reshape(M * KV * G * BS, 1, D)
    k2 = k_all.reshape(-1, D).index_select(0, idx2t).view(-1, 1, D)
    v2 = v_all.reshape(-1, D).index_select(0, idx2t).view(-1, 1, D)
    o2, l2, _, _, _ = fa(q2, k2, v2, cu_q2, cu_k2, BS * G, Lmax2, 0.0, False, False)
    # lse layouts
    if l1.dim() == 2:
        l1r = l1.t()  # [total_q, H]
    else:
        raise SystemExit(f"lse1 shape {tuple(l1.shape)}")
    l2r = l2.view(M, KV, G, BS).permute(0, 3, 1, 2).reshape(M * BS, H)
    o2r = o2.view(M, KV, G, BS, D).permute(0, 3, 1, 2, 4).reshape(M * BS, H, D)
    l1r = torch.where(torch.isinf(l1r), torch.full_like(l1r, -float("inf")), l1r)
    L = torch.logaddexp(l1r, l2r)
    o = (o1.float() * (l1r - L).exp().unsqueeze(-1) + o2r.float() * (l2r - L).exp().unsqueeze(-1)).to(dt)
    # backward with the merged output and LSE
    Lf1 = L.t().contiguous()
    dq1, dk1, dv1 = fb(dout, q, k1, v1, o, Lf1, cu_q1, cu_k1t, max_q1, max_k1, 0.0, False, seed, off)
    o_2 = o.view(M, BS, KV, G, D).permute(0, 2, 3, 1, 4).reshape(M * KV * G * BS, 1, D)
    do_2 = dout.view(M, BS, KV, G, D).permute(0, 2, 3, 1, 4).reshape(M * KV * G * BS, 1, D)
    L2 = L.view(M, BS, KV, G).permute(0, 2, 3, 1).reshape(1, -1).contiguous()
    dq2, dk2, dv2 = fb(do_2, q2, k2, v2, o_2, L2, cu_q2, cu_k2, BS * G, Lmax2, 0.0, False, seed, off)
    dq = dq1.float() + dq2.view(M, KV, G, BS, D).permute(0, 3, 1, 2, 4).reshape(M * BS, H, D).float()
    dk_all = torch.zeros(k_all.numel() // D, D, device=dev, dtype=torch.float32)
    dv_all = torch.zeros_like(dk_all)
    dk_all.index_add_(0, idx2t, dk2.view(-1, D).float())
    dv_all.index_add_(0, idx2t, dv2.view(-1, D).float())
    dk_all = dk_all.view(-1, KV, D)
    dv_all = dv_all.view(-1, KV, D)
    dk_all[: B * stride].index_add_(0, idx1, dk1.float())
    dv_all[: B * stride].index_add_(0, idx1, dv1.float())
    if check:
        return o, dq, dk_all, dv_all
    return o

# ---- dense reference (f32) per row
def reference():
    qf = q.float().detach().requires_grad_()
    kf = torch.cat([ctxk.reshape(B * stride, KV, D), bk]).float().detach().requires_grad_()
    vf = torch.cat([ctxv.reshape(B * stride, KV, D), bv]).float().detach().requires_grad_()
    outs = []
    g = 0
    for r, a in enumerate(anchors):
        n = len(a)
        qq = qf[g * BS:(g + n) * BS]  # [n*BS, H, D]
        keys_idx = torch.cat([torch.arange(r * stride, r * stride + S[r], device=dev), B * stride + torch.arange(g * BS, (g + n) * BS, device=dev)])
        kk = kf[keys_idx].repeat_interleave(G, 1)
        vv = vf[keys_idx].repeat_interleave(G, 1)
        at = torch.tensor(a, device=dev)
        qa = at.repeat_interleave(BS)
        sees_ctx = torch.arange(S[r], device=dev)[None, :] < qa[:, None]
        blk = torch.arange(n * BS, device=dev) // BS
        sees_blk = blk[:, None] == blk[None, :]
        mask = torch.cat([sees_ctx, sees_blk], 1)
        sc = torch.einsum("qhd,khd->hqk", qq, kk) * scale
        sc = sc.masked_fill(~mask[None], -float("inf"))
        p = sc.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vv))
        g += n
    out = torch.cat(outs)
    (out * dout.float()).sum().backward()
    return out, qf.grad, kf.grad, vf.grad

o, dq, dk, dv = split_forward_backward(check=True)
ro, rdq, rdk, rdv = reference()
def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()
print("rel err out %.2e dq %.2e dk %.2e dv %.2e" % (rel(o, ro), rel(dq, rdq), rel(dk, rdk), rel(dv, rdv)))

# ---- (a) today's: chunks of CPC blocks per row, calls of CALL entries, bucketed contexts, bias
def bucket(s):
    p = 1 << (s.bit_length() - 1)
    step = max(p // 16, 128)
    return (s + step - 1) // step * step
entries = []
for k in range(max(math.ceil(len(a) / CPC) for a in anchors)):
    for r, a in enumerate(anchors):
        if k * CPC < len(a):
            entries.append((r, a[k * CPC:(k + 1) * CPC]))
while len(entries) % CALL:
    entries.append((0, []))
calls = []
R = CPC * BS
for c in range(0, len(entries), CALL):
    es = entries[c:c + CALL]
    last = max([max(a) if a else 0 for (_, a) in es] + [1])
    ctx = min(bucket(last), max(S))
    qa = torch.zeros(CALL, R, dtype=torch.long)
    for i, (_, a) in enumerate(es):
        for t, an in enumerate(a):
            qa[i, t * BS:(t + 1) * BS] = an
    qa = qa.to(dev)
    sees_ctx = torch.arange(ctx, device=dev)[None, None, :] < qa[:, :, None]
    blk = torch.arange(R, device=dev) // BS
    sees_blk = (blk[:, None] == blk[None, :]).expand(CALL, R, R)
    m = torch.cat([sees_ctx, sees_blk], -1)
    bias = torch.zeros(CALL, 1, R, ctx + R, device=dev, dtype=dt).masked_fill(~m[:, None], -float("inf"))
    seqs = torch.tensor([r for (r, _) in es], device=dev)
    calls.append((ctx, seqs, bias))
qc = torch.randn(len(entries), H, R, D, device=dev, dtype=dt, requires_grad=True)
kc = torch.randn(len(entries), KV, R, D, device=dev, dtype=dt, requires_grad=True)
vc = torch.randn(len(entries), KV, R, D, device=dev, dtype=dt, requires_grad=True)
ckr = ctxk.transpose(1, 2).detach().requires_grad_()
cvr = ctxv.transpose(1, 2).detach().requires_grad_()
def today():
    outs = []
    for i, (ctx, seqs, bias) in enumerate(calls):
        sl = slice(i * CALL, (i + 1) * CALL)
        k = torch.cat([ckr[:, :, :ctx].index_select(0, seqs), kc[sl]], 2)
        v = torch.cat([cvr[:, :, :ctx].index_select(0, seqs), vc[sl]], 2)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qc[sl], k, v, attn_mask=bias, enable_gqa=True))
    out = torch.cat(outs)
    out.backward(torch.ones_like(out))
keys_today = sum(c[0] + R for c in calls) * CALL * R
print("today: query-key pairs %.3e; split part1 %.3e" % (keys_today, sum((n * BS) * af for (_, _, n, af) in chunks)))
t_today = timeit(today)
t_split = timeit(split_forward_backward)
print("one layer fwd+bwd ms: today %.3f  split %.3f" % (t_today, t_split))
def split_fwd_only():
    with torch.no_grad():
        ck = ctxk.reshape(B * stride, KV, D)
        k1 = ck.index_select(0, idx1)
        return fa(q, k1, k1, cu_q1, cu_k1t, max_q1, max_k1, 0.0, False, False)
print("part-1 forward alone ms %.3f" % timeit(split_fwd_only))

# ---- components of the split
ck = ctxk.reshape(B * stride, KV, D)
cv = ctxv.reshape(B * stride, KV, D)
k1 = ck.index_select(0, idx1); v1 = cv.index_select(0, idx1)
o1, l1, seed, off, _ = fa(q, k1, v1, cu_q1, cu_k1t, max_q1, max_k1, 0.0, False, False)
print("lse1", tuple(l1.shape), "seed", seed, off)
print("p1 fwd %.3f" % timeit(lambda: fa(q, k1, v1, cu_q1, cu_k1t, max_q1, max_k1, 0.0, False, False)))
print("p1 bwd %.3f" % timeit(lambda: fb(dout, q, k1, v1, o1, l1, cu_q1, cu_k1t, max_q1, max_k1, 0.0, False, seed, off)))
k_all = torch.cat([ck, bk]); v_all = torch.cat([cv, bv])
q2 = q.view(M, BS, KV, G, D).permute(0, 2, 3, 1, 4).reshape(M * KV * G * BS, 1, D)
k2 = k_all.reshape(-1, D).index_select(0, idx2t).view(-1, 1, D)
v2 = v_all.reshape(-1, D).index_select(0, idx2t).view(-1, 1, D)
o2, l2, _, _, _ = fa(q2, k2, v2, cu_q2, cu_k2, BS * G, Lmax2, 0.0, False, False)
print("p2 gather %.3f" % timeit(lambda: (k_all.reshape(-1, D).index_select(0, idx2t), v_all.reshape(-1, D).index_select(0, idx2t))))
print("p2 fwd %.3f" % timeit(lambda: fa(q2, k2, v2, cu_q2, cu_k2, BS * G, Lmax2, 0.0, False, False)))
do2 = dout.view(M, BS, KV, G, D).permute(0, 2, 3, 1, 4).reshape(M * KV * G * BS, 1, D)
print("p2 bwd %.3f" % timeit(lambda: fb(do2, q2, k2, v2, o2, l2, cu_q2, cu_k2, BS * G, Lmax2, 0.0, False, seed, off)))
# the same part 2 unfolded: 16 query rows per block, 32 heads, GQA natively
cu_q2u = torch.arange(0, M + 1, device=dev, dtype=torch.int32) * BS
rows2 = [r for rows in idx2 for r in rows]
cu2u = [0]
for rows in idx2:
    cu2u.append(cu2u[-1] + len(rows))
idx2u = torch.tensor(rows2, device=dev, dtype=torch.long)
cu_k2u = torch.tensor(cu2u, device=dev, dtype=torch.int32)
k2u = k_all.index_select(0, idx2u); v2u = v_all.index_select(0, idx2u)
o2u, l2u, _, _, _ = fa(q, k2u, v2u, cu_q2u, cu_k2u, BS, Lmax2, 0.0, False, False)
print("p2 unfolded fwd %.3f" % timeit(lambda: fa(q, k2u, v2u, cu_q2u, cu_k2u, BS, Lmax2, 0.0, False, False)))
print("p2 unfolded bwd %.3f" % timeit(lambda: fb(dout, q, k2u, v2u, o2u, l2u, cu_q2u, cu_k2u, BS, Lmax2, 0.0, False, seed, off)))
dk1 = torch.randn_like(k1)
acc = torch.zeros(B * stride, KV, D, device=dev)
print("index_add p1 f32 %.3f" % timeit(lambda: acc.index_add_(0, idx1, dk1.float())))
accb = torch.zeros(B * stride, KV, D, device=dev, dtype=dt)
print("index_add p1 bf16 %.3f" % timeit(lambda: accb.index_add_(0, idx1, dk1)))
