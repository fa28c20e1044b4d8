"""Rank functions (for spawn_group.run_on_ranks) that check ring attention against full
attention, count the attention work each rank does, and look at what activation
checkpointing does with the ring; and one that measures context parallel's memory."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import autotune_kernels.attention as kernels
from autotune.config import load_model, model_from_dict
from autotune.plan.layout import resolve
from autotune.runtime.data import micro_batches
from autotune.runtime.mesh import mesh_for
from autotune.runtime.parallel.recompute import keep_expensive_ops
from autotune.runtime.parallelize import build_trainer
from autotune.runtime.train import cross_entropy
from autotune.trialspec import TrialSpec
from support.step_probe import memory_by_kind


def random_inputs(case: dict):
    """q, k, v and an output gradient of a whole sequence, the same on every rank."""
    generator = torch.Generator().manual_seed(case["seed"])
    b, s, d = case["batch"], case["seq"], case["head_dim"]

    def draw(heads):
        return torch.randn(b, s, heads, d, generator=generator)

    return draw(case["heads"]), draw(case["kv_heads"]), draw(case["kv_heads"]), draw(case["heads"])


def full_attention(q, k, v, dout, causal: bool, window: int | None = None):
    """Torch's own SDPA on the whole sequence, differentiated by autograd; the
    log-sum-exp from the masked scores by definition. `window`: each query sees the
    last `window` positions (a bool band mask, built here from its definition)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    seq = q.shape[1]
    visible = torch.ones(seq, seq, dtype=torch.bool).tril()
    if window:
        visible &= torch.ones(seq, seq, dtype=torch.bool).triu(1 - window)
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal and not window,
                                         attn_mask=visible if window else None, enable_gqa=True).transpose(1, 2)
    out.backward(dout)
    k_rep = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(~visible, float("-inf"))
    return out.detach(), torch.logsumexp(scores, -1), *(t.grad for t in leaves)


class PairCounter:
    """Wraps the kernels the ring calls and counts the query-key pairs each call
    evaluates (a causal block of n queries: n(n+1)/2; a masked block: its visible
    pairs), per call in order."""

    def __init__(self):
        self.forward, self.backward = [], []
        self.original = kernels.attention_with_lse, kernels.attention_backward

    @staticmethod
    def pairs(q, k, causal, mask=None) -> int:
        if mask is not None:
            return int(mask.sum())
        return q.shape[1] * (q.shape[1] + 1) // 2 if causal else q.shape[1] * k.shape[1]

    def __enter__(self):
        forward, backward = self.original

        def counted_forward(q, k, v, causal, scale=None, mask=None):
            self.forward.append(self.pairs(q, k, causal, mask))
            return forward(q, k, v, causal, scale, mask)

        def counted_backward(dout, q, k, v, out, lse, causal, scale=None, mask=None):
            self.backward.append(self.pairs(q, k, causal, mask))
            return backward(dout, q, k, v, out, lse, causal, scale, mask)

        kernels.attention_with_lse, kernels.attention_backward = counted_forward, counted_backward
        return self

    def __exit__(self, *exc):
        kernels.attention_with_lse, kernels.attention_backward = self.original


def ring_against_full(cases: list[dict]) -> list[dict]:
    """Per case on this rank: the largest differences of the ring's output, log-sum-exp
    and gradients from full attention's (on this rank's tokens), and the pairs computed
    in each kernel call forward and backward. Causal cases are head-tail sharded,
    the others cut into contiguous blocks (any split works without a mask)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        causal, window = case["causal"], case.get("window")
        q, k, v, dout = random_inputs(case)
        full = full_attention(q, k, v, dout, causal, window)

        def mine(t, dim=1, causal=causal):
            return kernels.head_tail_shard(t, size, rank, dim) if causal else t.chunk(size, dim)[rank]

        local = [mine(t).requires_grad_() for t in (q, k, v)]
        with PairCounter() as counter:
            out, lse = kernels.ring_attention(*local, dist.group.WORLD, causal, window)
            out.backward(mine(dout))
        got = (out, lse, *(t.grad for t in local))
        expected = [mine(full[0]), mine(full[1], dim=2)] + [mine(t) for t in full[2:]]
        results.append({
            "errors": {name: (a - b).abs().max().item()
                       for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected)},
            "forward_pairs": counter.forward, "backward_pairs": counter.backward})
    return results


def ring_runs_under_checkpoint(case: dict) -> dict:
    """How many times the ring's forward runs in one forward + backward of a function
    that wraps it in torch's activation checkpoint, with the runtime's selective policy
    and fully; and whether the gradients still equal the unwrapped function's."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (kernels.head_tail_shard(t, size, rank) for t in random_inputs(case))

    def attend(q, k, v):
        return kernels.ring_attention(q * 1.5, k, v, dist.group.WORLD, True)[0]  # an op to recompute before it

    def run(wrap):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        runs = []
        original = kernels._ring_forward

        def counted(*args):
            runs.append(1)
            return original(*args)

        kernels._ring_forward = counted
        try:
            wrap(*leaves).backward(dout)
        finally:
            kernels._ring_forward = original
        return len(runs), [t.grad for t in leaves]

    def selective(*args):
        return checkpoint(attend, *args, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(keep_expensive_ops))

    def full(*args):
        return checkpoint(attend, *args, use_reentrant=False)

    plain_runs, plain_grads = run(attend)
    outcome = {"none": plain_runs}
    for name, wrap in (("selective", selective), ("full", full)):
        runs, grads = run(wrap)
        outcome[name] = runs
        outcome[f"{name}_grad_error"] = max((a - b).abs().max().item() for a, b in zip(grads, plain_grads))
    return outcome


def ring_checks(cases: list[dict], checkpoint_case: dict) -> dict:
    """Both of the above in one process group (starting processes costs seconds)."""
    return {"cases": ring_against_full(cases), "checkpoint": ring_runs_under_checkpoint(checkpoint_case)}


def cp_activation_bytes(model: dict, layouts: list[str]) -> list[dict]:
    """Per layout, on this rank, torch's MemTracker over one micro-batch of `model`:
    the activation bytes held at the end of the forward (what the backward will need)
    and the peak of activation bytes over forward and backward."""
    cfg = model_from_dict(model)
    results = []
    for text in layouts:
        layout = resolve(text, cfg, dist.get_world_size())
        mesh = mesh_for(layout, "cpu")
        trainer = build_trainer(cfg, layout, mesh, torch.device("cpu"), TrialSpec(model=model, layout=text))
        batch = micro_batches(0, 0, mesh["dp"].get_local_rank(), layout.mbs, layout.grad_accum(cfg),
                              cfg.seq_len, cfg.vocab_size)[0]
        trainer.step([batch])  # optimizer state and FSDP buffers exist from here on
        inputs, labels = trainer.shard_batch(*batch) if trainer.shard_batch else batch
        tracker = MemTracker()
        tracker.track_external(trainer.model, trainer.optimizer)
        with tracker:
            loss = cross_entropy(trainer.model(inputs), labels)
            held = memory_by_kind(tracker.get_tracker_snapshot("current"))["Activation"]
            loss.backward()
        results.append({"held": held, "peak": memory_by_kind(tracker.get_tracker_snapshot("peak"))["Activation"],
                        "tokens": inputs.numel()})
    return results


def tiny_with(**changes) -> dict:
    """The tiny preset with some fields changed, as a dict for TrialSpec."""
    return dataclasses.asdict(dataclasses.replace(load_model("tiny"), **changes))
