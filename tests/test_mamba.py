"""The Mamba-2 mixer (runtime/mamba.py) against the token-by-token recurrence and against
transformers' own NemotronHMamba2Mixer (its plain torch path), in fp32 on the CPU."""

import pytest
import torch

from autotune.config import model_from_dict
from autotune.runtime.mamba import Mamba2Mixer, causal_conv1d, naive_scan, ssd_scan

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def scan_inputs(seq, heads=4, groups=2, head_dim=3, state=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(2, seq, heads, generator=g, dtype=torch.float64) + 0.05
    A = -torch.rand(heads, generator=g, dtype=torch.float64) - 0.5
    B = torch.randn(2, seq, groups, state, generator=g, dtype=torch.float64)
    C = torch.randn(2, seq, groups, state, generator=g, dtype=torch.float64)
    D = torch.randn(heads, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


@pytest.mark.parametrize("seq, chunk", [(12, 4), (13, 4), (7, 16), (9, 1)])
def test_the_chunked_scan_is_the_recurrence(seq, chunk):
    """Outputs and every input's gradient, padded last chunks and a single chunk included."""
    inputs = scan_inputs(seq)
    ours, theirs = ssd_scan(*inputs, chunk), naive_scan(*inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(theirs)
    ours_grads = torch.autograd.grad((ours * weights).sum(), inputs)
    theirs_grads = torch.autograd.grad((theirs * weights).sum(), inputs)
    for a, b in zip(ours_grads, theirs_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_convolution_is_causal():
    x = torch.randn(1, 6, 3)
    weight, bias = torch.randn(3, 4), torch.randn(3)
    out = causal_conv1d(x, weight, bias)
    for t in range(6):
        window = torch.nn.functional.pad(x[0], (0, 0, 3, 0))[t: t + 4]  # x_{t-3} .. x_t
        torch.testing.assert_close(out[0, t], bias + (weight.T * window).sum(0))


def tiny(**mamba):
    return model_from_dict({
        "name": "m", "vocab_size": 32, "hidden_size": 24, "num_layers": 1, "num_heads": 2, "ffn_hidden_size": 8,
        "seq_len": 16, "global_batch_size": 2, "hybrid_pattern": "M",
        "mamba": {"state_size": 8, "num_heads": 6, "head_dim": 5, "n_groups": 3, "conv_kernel": 4,
                  "chunk_size": 4, **mamba}})


def test_the_mixer_is_transformers_nemotron_h_mixer():
    """Same weights (our five projections are rows of their fused in_proj), same output
    and the same input gradient; the width 6 * 5 = 30 is not expand * hidden = 48."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    cfg = tiny()
    m = cfg.mamba
    hf_cfg = transformers.NemotronHConfig(
        hidden_size=24, hybrid_override_pattern="M", ssm_state_size=8, mamba_num_heads=6, mamba_head_dim=5,
        n_groups=3, conv_kernel=4, chunk_size=4, expand=2, layer_norm_epsilon=cfg.norm_eps, vocab_size=32)
    theirs = nh.NemotronHMamba2Mixer(hf_cfg, layer_idx=0).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
        theirs.dt_bias.normal_(-1, 0.5)
    ours = Mamba2Mixer(cfg).double()
    inner, groups = m.inner, m.n_groups * m.state_size
    z, x, B, C, dt = theirs.in_proj.weight.split([inner, inner, groups, groups, m.num_heads])
    conv = theirs.conv1d.weight.squeeze(1)
    with torch.no_grad():
        for name, w in (("in_z", z), ("in_x", x), ("in_B", B), ("in_C", C), ("in_dt", dt)):
            getattr(ours, name).weight.copy_(w)
        for name, part, bias in zip(("conv_x", "conv_B", "conv_C"), conv.split([inner, groups, groups]),
                                    theirs.conv1d.bias.split([inner, groups, groups])):
            getattr(ours, name).copy_(part)
            getattr(ours, f"{name}_bias").copy_(bias)
        for name in ("A_log", "D", "dt_bias"):
            getattr(ours, name).copy_(getattr(theirs, name))
        ours.norm.weight.copy_(theirs.norm.weight)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
    hidden = torch.randn(2, 11, 24, dtype=torch.float64, requires_grad=True)
    theirs.eval()  # the torch path (training mode would try a hub kernel first)
    expected = theirs(hidden)
    got = ours(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(got)
    ours_grad, = torch.autograd.grad((got * weights).sum(), hidden)
    theirs_grad, = torch.autograd.grad((expected * weights).sum(), hidden)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-6)
