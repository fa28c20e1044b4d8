"""The attention kernels: the fused ops and their log-sum-exp against the plain math,
head-tail sharding, and ring attention against full attention on real gloo groups
(forward, backward, GQA, causal and not), with the attention work of each rank
counted, and activation checkpointing keeping the ring whole under op recompute."""

import pytest
import torch

from autotune_kernels.attention import (
    attention_backward,
    attention_backward_reference,
    attention_reference,
    attention_with_lse,
    head_tail_positions,
    head_tail_shard,
    window_mask,
)
from support.ring_probe import ring_checks
from support.spawn_group import run_on_ranks

TOL = 1e-5  # fp32


def inputs(batch=2, q_len=24, k_len=24, heads=8, kv_heads=4, head_dim=8, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(0)

    def draw(seq, h):
        return torch.randn(batch, seq, h, head_dim, generator=generator).to(device, dtype)

    return draw(q_len, heads), draw(k_len, kv_heads), draw(k_len, kv_heads), draw(q_len, heads)


def max_error(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("causal,q_len,k_len,kv_heads", [
    (True, 24, 24, 4), (True, 24, 24, 8), (True, 24, 24, 1), (False, 12, 24, 4), (False, 24, 12, 2)])
def test_fused_op_and_its_log_sum_exp_equal_the_math(causal, q_len, k_len, kv_heads):
    """Causal and not, GQA (4 and 1 kv heads for 8 query heads) and MHA, fewer or more
    queries than keys without a mask; the backward given the forward's out and lse."""
    q, k, v, dout = inputs(q_len=q_len, k_len=k_len, kv_heads=kv_heads)
    out, lse = attention_with_lse(q, k, v, causal)
    ref_out, ref_lse = attention_reference(q, k, v, causal)
    assert lse.shape == (2, 8, q_len) and lse.dtype == torch.float32
    assert max_error(out, ref_out) <= TOL and max_error(lse, ref_lse) <= TOL
    fused = attention_backward(dout, q, k, v, out, lse, causal)
    math = attention_backward_reference(dout, q, k, v, ref_out, ref_lse, causal)
    assert [t.shape for t in fused] == [q.shape, k.shape, v.shape]
    assert all(max_error(a, b) <= TOL for a, b in zip(fused, math))


def test_masked_kernel_equals_the_math_and_leaves_keyless_rows_out():
    """A window's edge block: the bool mask of visible pairs, some rows seeing no key. Those
    rows must come back with lse -inf and output 0 (the CPU kernel itself reports lse 0),
    so that merging them into the ring's result changes nothing."""
    q, k, v, dout = inputs()
    mask = window_mask(24, 24, offset=20, window=8, device="cpu")  # rows 4.. see no key
    assert not mask[-1].any() and mask[0].any()
    out, lse = attention_with_lse(q, k, v, False, mask=mask)
    ref_out, ref_lse = attention_reference(q, k, v, False, mask=mask)
    assert torch.isneginf(lse[..., ~mask.any(-1)]).all() and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    seen = mask.any(-1)
    assert max_error(out, ref_out) <= TOL and max_error(lse[..., seen], ref_lse[..., seen]) <= TOL
    finite = lse.masked_fill(~seen, 0.0)  # as the ring differentiates: against a finite merged lse
    fused = attention_backward(dout, q, k, v, out, finite, False, mask=mask)
    math = attention_backward_reference(dout, q, k, v, out, finite, False, mask=mask)
    assert all(max_error(a, b) <= TOL for a, b in zip(fused, math))
    assert fused[0][:, ~seen].abs().max() == 0  # keyless rows get no query gradient


def test_math_backward_is_the_gradient_of_the_math_forward():
    q, k, v, dout = inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, causal=True)
    out.backward(dout)
    ours = attention_backward_reference(dout, q, k, v, out.detach(), lse.detach(), causal=True)
    assert all(max_error(a, leaf.grad) <= TOL for a, leaf in zip(ours, leaves))


def test_backward_differentiates_against_the_lse_it_is_given():
    """The ring passes the merged lse of all blocks; a kernel that recomputed its own
    would ignore it."""
    q, k, v, dout = inputs()
    out, lse = attention_with_lse(q, k, v, causal=False)
    shifted = attention_backward(dout, q, k, v, out, lse + 0.5, causal=False)
    assert max_error(shifted[2], attention_backward(dout, q, k, v, out, lse, causal=False)[2]) > 0.1
    assert all(max_error(a, b) <= TOL for a, b in zip(
        shifted, attention_backward_reference(dout, q, k, v, out, lse + 0.5, causal=False)))


def test_causal_blocks_must_be_square():
    q, k, v, _ = inputs(q_len=12)
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
        attention_with_lse(q, k, v, causal=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel needs a GPU")
def test_cuda_flash_kernel_equals_the_math_in_bf16():
    q, k, v, dout = inputs(head_dim=64, dtype=torch.bfloat16, device="cuda")
    out, lse = attention_with_lse(q, k, v, causal=True)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert max_error(out, ref_out) <= 2e-2 and max_error(lse, ref_lse) <= 2e-2
    fused = attention_backward(dout, q, k, v, out, lse, causal=True)
    math = attention_backward_reference(dout, q, k, v, out, lse, causal=True)
    assert all(max_error(a, b) <= 5e-2 for a, b in zip(fused, math))


def test_head_tail_shards_partition_the_sequence():
    """seq 16 over 2 ranks: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2."""
    assert head_tail_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert head_tail_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    tokens = torch.arange(3 * 48).view(3, 48)
    shards = [head_tail_shard(tokens, 4, r) for r in range(4)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, tokens[:, head_tail_positions(48, 4, r)])
    assert sorted(torch.cat(shards, dim=1)[0].tolist()) == list(range(48))
    with pytest.raises(ValueError, match=r"seq_len \(20\) divisible by 2\*size \(8\)"):
        head_tail_positions(20, 4, 0)


def case(causal, seq=32, heads=8, kv_heads=4, seed=0, window=None):
    return {"causal": causal, "batch": 2, "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": 8,
            "seed": seed, "window": window}


# Windows of 3 and 11 tokens: inside one chunk and across chunks, at cp 2 (chunks of 8) and 4 (of 4).
CASES = [case(True), case(True, kv_heads=8, seed=1), case(True, kv_heads=1, seed=2), case(False, seed=3),
         case(True, seed=4, window=3), case(True, kv_heads=2, seed=5, window=11)]


def band_pairs(seq: int, window: int) -> int:
    """Query-key pairs a causal window of `window` tokens holds: query i sees min(i+1, window) keys."""
    return sum(min(i + 1, window) for i in range(seq))


def check_ring(ranks: list[dict], size: int) -> None:
    for i, spec in enumerate(CASES):
        results = [r["cases"][i] for r in ranks]
        for rank, r in enumerate(results):
            assert max(r["errors"].values()) <= TOL, (size, spec, rank, r["errors"])
        seq, steps = spec["seq"], [r["forward_pairs"] for r in results]
        assert all(r["backward_pairs"] == r["forward_pairs"] for r in results)
        if spec["window"]:
            # Only pairs inside the window are computed (none empty), each once over the ranks;
            # far fewer kernel calls than 4 chunk pairs a step.
            assert all(all(pairs > 0 for pairs in s) for s in steps)
            assert sum(map(sum, steps)) == band_pairs(seq, spec["window"])
            assert max(map(len, steps)) < 4 * size
            continue
        assert all(len(s) == size for s in steps)  # one block per ring step
        if spec["causal"]:
            # Balanced: every rank the same pairs at every step, c(2c+1) on its own block
            # then 2c^2, c = seq/(2*size); together each pair of the causal mask once.
            c = seq // (2 * size)
            assert steps == [[c * (2 * c + 1)] + [2 * c * c] * (size - 1)] * size
            assert sum(map(sum, steps)) == seq * (seq + 1) // 2
        else:
            assert steps == [[(seq // size) ** 2] * size] * size


@pytest.mark.parametrize("size", [2, 4])
def test_ring_attention_equals_full_attention_and_balances_work(size):
    """cp 2 and 4; causal (GQA 8:4, MHA, MQA 8:1) head-tail sharded, and not causal, and
    sliding windows: output, lse and dq/dk/dv within 1e-5 of full attention's on each
    rank's tokens."""
    ranks = run_on_ranks(size, ring_checks, CASES, case(True))
    check_ring(ranks, size)
    for r in ranks:
        runs = r["checkpoint"]
        # Selective recompute keeps the ring's outputs (no second pass of KV round the
        # ring); full recompute runs it again in backward. Gradients unchanged.
        assert (runs["none"], runs["selective"], runs["full"]) == (1, 1, 2)
        assert runs["selective_grad_error"] <= TOL and runs["full_grad_error"] <= TOL
