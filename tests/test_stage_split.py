"""The pipeline split: which layers each stage holds (the embedding and the head weighed
as layers), which stages each rank runs, and the pruned stage modules the runtime builds."""

import dataclasses

import pytest
import torch

from autotune.config import load_model
from autotune.plan.layout import Layout
from autotune.plan.stage_split import end_weight, rank_stage_ids, stage_layers
from autotune.runtime.model import Transformer
from autotune.runtime.parallel.pp import split_stages

TINY = load_model("tiny")
LLAMA_8B = load_model("llama3-8b")


def counts(model, stages: int) -> list[int]:
    return [len(r) for r in stage_layers(model, stages)]


def test_end_weight_is_the_heads_flops_over_a_mean_layers():
    # tiny: head 6*256*64 = 98,304 FLOPs per token; a layer 6*36,864 + 12*8*8*64 = 270,336.
    assert end_weight(TINY) == pytest.approx(98_304 / 270_336)
    assert end_weight(LLAMA_8B) == pytest.approx(1.84, abs=0.01)


def test_tiny_splits_evenly_and_llama_8b_lightens_the_ends():
    assert counts(TINY, 2) == [4, 4] and counts(TINY, 4) == [2, 2, 2, 2] and counts(TINY, 8) == [1] * 8
    assert counts(LLAMA_8B, 4) == [7, 9, 9, 7]  # weights 7 + 1.84, 9, 9, 7 + 1.84 against 8.92 each
    assert counts(LLAMA_8B, 8) == [3, 4, 5, 4, 4, 5, 4, 3]


@pytest.mark.parametrize("vocab", [256, 8192, 128_000])
@pytest.mark.parametrize("layers, stages", [(8, 1), (8, 3), (8, 8), (13, 4), (32, 6), (80, 16)])
def test_every_layer_once_in_order_and_stages_within_a_layer_of_the_even_share(vocab, layers, stages):
    """Stages cover the layers in order, each at least one; where the ends' weight leaves
    room, no stage is more than one layer off its share (layers + 2 * weight) / stages."""
    model = dataclasses.replace(TINY, vocab_size=vocab, num_layers=layers)
    spans = stage_layers(model, stages)
    assert [i for span in spans for i in span] == list(range(layers))
    assert all(len(span) >= 1 for span in spans)
    weight = end_weight(model)
    share = (layers + 2 * weight) / stages
    loads = [len(span) + weight * (i in (0, stages - 1)) for i, span in enumerate(spans)]
    if stages > 1 and weight + 1 <= share:
        assert max(loads) - share <= 1 and share - min(loads) <= 1, loads


def test_a_stage_per_layer_and_too_few_layers():
    assert counts(TINY, 8) == [1] * 8
    with pytest.raises(ValueError, match="8 layers cannot fill 9 stages"):
        stage_layers(TINY, 9)


def test_stage_ids_looped_and_v_shaped():
    assert [rank_stage_ids(Layout(pp=4, schedule="1f1b"), r) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    looped = Layout(pp=4, vpp=2, schedule="interleaved_1f1b")
    assert [rank_stage_ids(looped, r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    v_shape = Layout(pp=4, vpp=2, schedule="zbv")
    assert [rank_stage_ids(v_shape, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.parametrize("schedule, vpp", [("1f1b", 1), ("interleaved_1f1b", 2), ("dualpipev", 2)])
def test_split_stages_prunes_copies_that_together_hold_the_model_once(schedule, vpp):
    """Each stage keeps its layers under their global names; only stage 0 has the
    embedding, only the last stage the final norm and head; the ranks' stages together
    hold every parameter of the model exactly once."""
    layout = Layout(pp=2, vpp=vpp, schedule=schedule)
    with torch.device("meta"):
        model = Transformer(TINY)
    spans = stage_layers(TINY, 2 * vpp)
    seen = []
    for rank in range(2):
        parts = split_stages(model, TINY, layout, rank)
        assert sorted(parts) == sorted(rank_stage_ids(layout, rank))
        for stage_id, part in parts.items():
            assert [int(name) for name in part.layers] == list(spans[stage_id])
            assert (part.tok_embeddings is not None) == (stage_id == 0)
            assert (part.output is not None) == (part.norm is not None) == (stage_id == 2 * vpp - 1)
            seen += [name for name, _ in part.named_parameters()]
    assert sorted(seen) == sorted(name for name, _ in model.named_parameters())
