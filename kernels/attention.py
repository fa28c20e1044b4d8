"""Attention that returns its log-sum-exp, and ring attention for context parallel.

Shapes follow the model (runtime/model.py): q is [batch, seq, heads, head_dim], k and v
[batch, seq, kv_heads, head_dim] with heads a multiple of kv_heads (GQA: query head h
uses kv head h // (heads / kv_heads)). The log-sum-exp is fp32 [batch, heads, seq]:

    lse_i = log sum_j exp(scale * q_i . k_j)     out_i = sum_j exp(scale * q_i . k_j - lse_i) v_j

over the keys query i sees (causal: keys 0..i; causal blocks are square here).

`attention_with_lse` / `attention_backward` run the device's fused kernel where there
is one and the plain math (`attention_reference`, `attention_backward_reference`)
elsewhere:
    CPU   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): every float
          dtype, GQA natively (kv heads are never repeated).
    CUDA  aten._flash_attention_forward (+ _backward), FlashAttention-2: fp16/bf16 (what
          mixed precision computes in) on Ampere or newer, head_dim a multiple of 8 up to
          256, GQA natively. Other dtypes and GPUs take the math path.
The fused backward takes the output and log-sum-exp as arguments instead of
recomputing them, which is what lets the ring differentiate a block against the
merged result of all blocks.

Ring attention (`ring_attention`): each of the `size` ranks of a process group holds
its queries and one block of keys/values. The KV blocks travel around the ring (rank r
sends to r+1, receives from r-1) with batched P2P, the next transfer in flight while
the current block is computed; each block's (out, lse) is merged into the running
result with the online-softmax rule

    lse = logaddexp(lse, lse_b)      out = exp(lse_old - lse) * out + exp(lse_b - lse) * out_b

Backward passes the KV blocks around the same way; each rank computes the gradients
of its queries against the block it holds (the fused backward, given the merged out
and lse), and the dK/dV of a block travel with it, one step behind, accumulating each
rank's share in fp32, until they arrive back at the block's owner.

Causal masks use head-tail (zig-zag) sharding: the sequence is cut into 2*size chunks
and rank r holds chunks r and 2*size-1-r (`head_tail_positions`). Rank r's queries then
need, of the block from rank s:
    s == r  both chunks, causal (the concatenation's causal mask is exactly right)
    s <  r  the block's head chunk only (both of r's chunks come after it; the tail
            chunk of s comes after both)
    s >  r  only r's tail chunk, against the whole block
so every rank computes the same number of query-key pairs at every step (2c^2 for
chunks of c tokens, c(2c+1) at step 0). Without a causal mask every block is whole.

Sliding windows (query i sees keys i-W < j <= i: Mistral, Gemma 2/3, GPT-OSS) cut the
ring's work by chunk pairs instead (`ring_pairs`): of the 2 x 2 pairs of query and key
chunks at a step, a pair wholly outside the window is skipped (never computed, never
masked), one wholly inside runs unmasked, and only a pair the window's edge crosses
takes a mask. A window of W tokens therefore costs about W/seq of full causal
attention's pairs on every rank. The kernels take that mask as an additive float mask
(the CPU flash kernel's form); on CUDA a masked block takes the math path. Rows a masked
block leaves without a key get lse -inf and output 0, so that merging them changes
nothing (the CPU kernel reports lse 0 for them).

The ring is a torch custom op with a registered backward rather than a bare
autograd.Function so that selective activation checkpointing sees it as one kernel
whose outputs it keeps, as it keeps the fused SDPA kernels', instead of recording and
replaying the P2P transfers inside it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autotune.runtime.torch_compat import resolve_process_group

aten = torch.ops.aten

# P2P tags: the KV blocks and the dK/dV accumulators travel between the same ranks at once.
KV_TAG, GRAD_TAG = 1, 2


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _check_causal(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[1]} and {k.shape[1]}")


# -- the plain math ----------------------------------------------------------------------------

def _probabilities(q, k, lse, causal, scale, mask=None):
    """exp(scale * q.k - lse) in fp32 [batch, heads, q, k], kv heads repeated for GQA;
    `mask` a bool [q, k] of the visible pairs. A row that sees no key has lse -inf and
    probabilities 0."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[1], k.shape[1], dtype=torch.bool,
                                               device=q.device).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None])
    return (p.nan_to_num(0.0) if mask is not None else p), lse


def attention_reference(q, k, v, causal: bool, scale: float | None = None, mask: torch.Tensor | None = None):
    """(out, lse) by the definition, materialising the scores and the repeated kv heads."""
    _check_causal(q, k, causal)
    p, lse = _probabilities(q, k, None, causal, _scale(q, scale), mask)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.float()).to(q.dtype), lse


def attention_backward_reference(dout, q, k, v, out, lse, causal: bool, scale: float | None = None,
                                 mask: torch.Tensor | None = None):
    """(dq, dk, dv) of `out` = attention(q, k, v) given out and its lse (which need not be
    this block's own: the ring passes the merged ones). With P the probabilities and
    D_i = dout_i . out_i:  dV = P^T dout,  dS = P * (dout V^T - D),  dQ = scale dS K,
    dK = scale dS^T Q; GQA sums dK and dV over the query heads that share a kv head."""
    _check_causal(q, k, causal)
    scale = _scale(q, scale)
    groups = q.shape[2] // k.shape[2]
    p, _ = _probabilities(q, k, lse, causal, scale, mask)
    dout32 = dout.float()
    k_rep, v_rep = (t.repeat_interleave(groups, dim=2).float() for t in (k, v))
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout32)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout32, v_rep)
    delta = (dout32 * out.float()).sum(-1).transpose(1, 2)  # [batch, heads, q]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_rep) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale

    def per_kv_head(t):
        return t.unflatten(2, (k.shape[2], groups)).sum(3)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


# -- the device's fused kernels ----------------------------------------------------------------

def _cuda_flash(q: torch.Tensor) -> bool:
    """FlashAttention-2's conditions: built in, an Ampere or newer GPU, half precision,
    head_dim a multiple of 8 up to 256."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask of visible pairs as the CPU kernel takes it: 0 where visible, -inf elsewhere."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_with_lse(q, k, v, causal: bool, scale: float | None = None, mask: torch.Tensor | None = None):
    """(out, lse) of attention, by the device's fused kernel where there is one; `mask` a
    bool [q, k] of the visible pairs (rows that see none: out 0, lse -inf)."""
    _check_causal(q, k, causal)
    if q.device.type == "cpu":
        # The CPU op works on [batch, heads, seq, head_dim]; its output's memory is
        # [batch, seq, heads, head_dim], so transposing back costs nothing.
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal,
            attn_mask=_additive(mask, q.dtype), scale=scale)
        out = out.transpose(1, 2)
        if mask is not None:  # the kernel reports lse 0 for a row without keys: a weight of one
            seen = mask.any(-1)
            out = out.masked_fill(~seen[None, :, None, None], 0.0)
            lse = lse.masked_fill(~seen[None, None, :], float("-inf"))
        return out, lse
    if mask is not None:
        return attention_reference(q, k, v, causal, scale, mask)
    if _cuda_flash(q):
        out, lse, *_ = aten._flash_attention_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal,
                                                     False, scale=scale)
        return out, lse
    return attention_reference(q, k, v, causal, scale)


def attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None,
                       mask: torch.Tensor | None = None):
    """(dq, dk, dv) given the output and log-sum-exp to differentiate against (finite:
    the ring passes the merged lse, in which every query has seen its own key)."""
    _check_causal(q, k, causal)
    if q.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), out.transpose(1, 2),
            lse, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if mask is not None:
        return attention_backward_reference(dout, q, k, v, out, lse, causal, scale, mask)
    if _cuda_flash(q):
        # Dense inputs (no cumulative sequence lengths) and no dropout: the RNG state is not read.
        no_rng = torch.empty(2, dtype=torch.int64, device=q.device)
        return aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, causal,
            no_rng, torch.empty(0, device=q.device), scale=scale)
    return attention_backward_reference(dout, q, k, v, out, lse, causal, scale)


# -- head-tail sharding and the ring's schedule ------------------------------------------------

def head_tail_positions(seq_len: int, size: int, rank: int, device=None) -> torch.Tensor:
    """Positions of rank `rank`'s tokens: chunks rank and 2*size-1-rank of 2*size chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"head-tail sharding needs seq_len ({seq_len}) divisible by 2*size ({2 * size})")
    chunk = seq_len // (2 * size)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)])


def head_tail_shard(tensor: torch.Tensor, size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's head-tail shard of `tensor` along `dim` (a copy)."""
    chunks = tensor.chunk(2 * size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=dim)


def ring_block(rank: int, size: int, step: int, causal: bool, length: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal?) rank `rank` computes at ring step `step`, when it
    holds the block of rank (rank - step) % size and `length` local tokens (module doc)."""
    whole, head, tail = slice(0, length), slice(0, length // 2), slice(length // 2, length)
    if not causal:
        return whole, whole, False
    source = (rank - step) % size
    if source == rank:
        return whole, whole, True
    return (whole, head, False) if source < rank else (tail, whole, False)


def ring_pairs(rank: int, size: int, step: int, causal: bool, length: int,
               window: int = 0) -> list[tuple[slice, slice, bool, int | None]]:
    """[(query rows, key rows, causal?, window offset)] rank `rank` computes at ring step
    `step`. Without a window: the one block of `ring_block`, offset None (no mask). With a
    window (causal, head-tail sharded): the chunk pairs the window reaches, the diagonal
    ones first (so every query has a key before anything is merged into it); offset is
    how many positions the query chunk starts after the key chunk, None where the pair
    needs no mask (a diagonal the window covers is plain causal; a pair inside it whole)."""
    if not window:
        return [(*ring_block(rank, size, step, causal, length), None)]
    chunk, source = length // 2, (rank - step) % size
    ours, theirs = (rank, 2 * size - 1 - rank), (source, 2 * size - 1 - source)
    pairs = []
    for a, q_chunk in enumerate(ours):
        for b, k_chunk in enumerate(theirs):
            if k_chunk > q_chunk:
                continue
            # distances (query position - key position) the pair spans: nearest and farthest
            gap = (q_chunk - k_chunk) * chunk
            nearest, farthest = max(gap - chunk + 1, 0), gap + chunk - 1
            if nearest >= window:
                continue
            rows, keys = slice(a * chunk, (a + 1) * chunk), slice(b * chunk, (b + 1) * chunk)
            offset = None if farthest < window else gap
            pairs.append((gap, (rows, keys, gap == 0 and offset is None, offset)))
    return [pair for gap, pair in sorted(pairs, key=lambda item: item[0] != 0)]


def window_mask(queries: int, keys: int, offset: int, window: int, device) -> torch.Tensor:
    """Bool [queries, keys]: query i (at position offset + i, keys from 0) sees key j when
    0 <= offset + i - j < window (causal, the last `window` positions)."""
    distance = offset + torch.arange(queries, device=device)[:, None] - torch.arange(keys, device=device)[None, :]
    return (distance >= 0) & (distance < window)


def _pass_on(tensor: torch.Tensor, group, rank: int, size: int, tag: int):
    """Send `tensor` to the next rank and receive the previous rank's into a new buffer;
    returns (buffer, pending works). One rank keeps its own tensor."""
    if size == 1:
        return tensor, []
    incoming = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % size, tag=tag),
        dist.P2POp(dist.irecv, incoming, group=group, group_peer=(rank - 1) % size, tag=tag)])
    return incoming, works


def _wait(works) -> None:
    for work in works:
        work.wait()


def _merge(out, lse, block_out, block_lse) -> None:
    """Online softmax: fold one block's (out, lse) into the running fp32 (out, lse), in place."""
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).transpose(1, 2).unsqueeze(-1))
    out.add_(block_out.float() * torch.exp(block_lse - merged).transpose(1, 2).unsqueeze(-1))
    lse.copy_(merged)


# -- ring attention ------------------------------------------------------------------------------

def _pair_mask(rows: slice, keys: slice, offset: int | None, window: int, device):
    if offset is None:
        return None
    return window_mask(rows.stop - rows.start, keys.stop - keys.start, offset, window, device)


def _ring_forward(q, k, v, group, causal: bool, window: int = 0):
    rank, size, length = dist.get_rank(group), dist.get_world_size(group), q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], length), float("-inf"), device=q.device)
    kv = torch.stack((k, v))  # one buffer per hop
    for step in range(size):
        last = step == size - 1
        if not last:
            incoming, works = _pass_on(kv, group, rank, size, KV_TAG)
        for rows, keys, block_causal, offset in ring_pairs(rank, size, step, causal, length, window):
            mask = _pair_mask(rows, keys, offset, window, q.device)
            block_out, block_lse = attention_with_lse(q[:, rows], kv[0][:, keys], kv[1][:, keys], block_causal,
                                                      mask=mask)
            _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
        if not last:
            _wait(works)
            kv = incoming
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, causal: bool, window: int = 0):
    rank, size, length = dist.get_rank(group), dist.get_world_size(group), q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    arriving, grad_works = None, ()  # the dK/dV accumulator in flight from the previous rank
    for step in range(size):
        last = step == size - 1
        if not last:
            incoming, kv_works = _pass_on(kv, group, rank, size, KV_TAG)
        if step == 0:
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        else:  # the previous rank's accumulated dK/dV of the block this rank now holds
            _wait(grad_works)
            dkv = arriving
        for rows, keys, block_causal, offset in ring_pairs(rank, size, step, causal, length, window):
            block_dq, block_dk, block_dv = attention_backward(
                dout[:, rows], q[:, rows], kv[0][:, keys], kv[1][:, keys], out[:, rows], lse[:, :, rows],
                block_causal, mask=_pair_mask(rows, keys, offset, window, q.device))
            dq[:, rows] += block_dq
            dkv[0][:, keys] += block_dk
            dkv[1][:, keys] += block_dv
        arriving, grad_works = _pass_on(dkv, group, rank, size, GRAD_TAG)
        if not last:
            _wait(kv_works)
            kv = incoming
    _wait(grad_works)  # after size passes the accumulator holds this rank's own block
    return dq.to(q.dtype), arriving[0].to(k.dtype), arriving[1].to(v.dtype)


@torch.library.custom_op("autotune::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       causal: bool, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, resolve_process_group(group_name), causal, window)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, group_name, causal, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.group_name, ctx.causal, ctx.window = group_name, causal, window
    ctx.mark_non_differentiable(lse)


def _ring_attention_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, resolve_process_group(ctx.group_name), ctx.causal,
                                ctx.window)
    return dq, dk, dv, None, None, None


torch.library.register_autograd("autotune::ring_attention", _ring_attention_backward,
                                setup_context=_setup_context)

RING_ATTENTION_OP = torch.ops.autotune.ring_attention.default


def ring_attention(q, k, v, group: dist.ProcessGroup, causal: bool, window: int | None = None):
    """(out, lse) of attention over the keys of every rank of `group`; differentiable in
    q, k and v (not through lse). Causal inputs must be head-tail sharded; `window`: each
    query sees only the last `window` positions (causal only)."""
    _check_causal(q, k, causal)
    if window and not causal:
        raise ValueError("a sliding window needs causal attention")
    return RING_ATTENTION_OP(q, k, v, group.group_name, causal, window or 0)
