"""Rank functions (for spawn_group.run_on_ranks) that look inside training steps: the
gradients a layout hands its optimizer, what mixed precision computes in, the local
shapes TP leaves, and the memory a rank holds."""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor

from autotune.config import load_model
from autotune.plan.layout import resolve
from autotune.runtime.data import batch_rows, micro_batches
from autotune.runtime.init import init_weights, plain_name
from autotune.runtime.mesh import mesh_for
from autotune.runtime.model import Transformer
from autotune.runtime.parallelize import build_trainer, parallelize_stage
from autotune.runtime.train import cross_entropy
from autotune.runtime.trial import global_losses
from autotune.trialspec import TrialSpec

MODEL = "tiny"


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def step_batches(cfg, layout, mesh, step: int):
    return micro_batches(0, step, mesh["dp"].get_local_rank(), layout.mbs, layout.grad_accum(cfg),
                         cfg.seq_len, cfg.vocab_size)


def trainer_for(text: str, model: str = MODEL, dtype: str = "fp32", grad_dtype: str = "fp32", **spec_fields):
    """(model config, layout, meshes, trainer) of a full layout string, as a trial builds them
    (in `dtype`, the precision the model trains in, with gradients in `grad_dtype`)."""
    cfg = dataclasses.replace(load_model(model), dtype=dtype, grad_dtype=grad_dtype)
    layout = resolve(text, cfg, dist.get_world_size())
    mesh = mesh_for(layout, "cpu")
    trainer = build_trainer(cfg, layout, mesh, torch.device("cpu"),
                            TrialSpec(model=dataclasses.asdict(cfg), layout=text, **spec_fields))
    return cfg, layout, mesh, trainer


def model_parts(trainer) -> list:
    """The modules a rank trains: the model, or its pipeline stages."""
    return trainer.model if isinstance(trainer.model, list) else [trainer.model]


def memory_by_kind(snapshot: dict) -> dict:
    """MemTracker's CPU snapshot keyed by plain names: Parameter, Activation, ..., Total."""
    return {getattr(kind, "value", kind): size for kind, size in snapshot[torch.device("cpu")].items()}


def first_step_gradients(layouts: list[str], model: str = MODEL, spec_fields: dict | None = None) -> list[dict] | None:
    """{plain name: flat list} of the full gradients the optimizer sees at step 0 (after
    clipping, if `spec_fields` asks for it), per layout, gathered from every pipeline
    stage (on rank 0; None elsewhere)."""
    results = []
    for text in layouts:
        cfg, layout, mesh, trainer = trainer_for(text, model, **(spec_fields or {}))
        grads = {}

        def capture(optimizer, args, kwargs, trainer=trainer, grads=grads):
            for part in model_parts(trainer):
                for name, param in part.named_parameters():
                    grads[plain_name(name)] = full(trainer.dp.gradient(param)).flatten().tolist()

        trainer.optimizer.register_step_pre_hook(capture)
        trainer.step(step_batches(cfg, layout, mesh, 0))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, grads)
        results.append({name: grad for rank_grads in everyone for name, grad in rank_grads.items()})
    return results if dist.get_rank() == 0 else None


def reference_gradients(model: str = MODEL) -> dict:
    """The gradients of the mean loss over step 0's whole global batch, in this process:
    the plain model, no process group, no micro-batches (an MoE model's balance losses
    included: its blocks add them in backward)."""
    cfg = load_model(model)
    net = Transformer(cfg)
    init_weights(net, 0, cfg.hidden_size, cfg.num_layers)
    tokens = batch_rows(0, 0, range(cfg.global_batch_size), cfg.seq_len, cfg.vocab_size)
    cross_entropy(net(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {name: p.grad.flatten().tolist() for name, p in net.named_parameters()}


def assert_same_gradients(reference: dict, other: dict, what: str, rtol: float = 1e-4) -> None:
    """Each parameter's gradient equals the reference within rtol of the reference's norm."""
    assert sorted(reference) == sorted(other), f"{what}: parameter names differ"
    for name, ref in reference.items():
        diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(ref, other[name])))
        norm = math.sqrt(sum(a * a for a in ref))
        assert len(ref) == len(other[name]) and diff <= rtol * norm, \
            f"{what}: gradient of {name} differs by {diff / norm:.2e} of its norm (rtol {rtol})"


def mixed_precision_step(layouts: list[str], steps: int = 3, grad_dtype: str = "fp32") -> list[dict]:
    """Train each layout in bf16 on the CPU; report the dtypes of what a Linear computes
    in, of the gradients the optimizer sees, of the parameters the model holds, of what
    the optimizer updates and of its state, and of zero 0/1's gradient buffers."""
    results = []
    for text in layouts:
        cfg, layout, mesh, trainer = trainer_for(text, dtype="bf16", grad_dtype=grad_dtype)
        model = trainer.model
        seen = {"compute": [], "grads": set()}

        def linear_input(module, args, seen=seen):
            seen["compute"] = [str(args[0].dtype), str(module.weight.dtype)]

        def gradient_dtypes(optimizer, args, kwargs, seen=seen):
            seen["grads"] |= {str(p.grad.dtype) for group in optimizer.param_groups for p in group["params"]
                              if p.grad is not None}

        model.layers["3"].attention.wq.register_forward_pre_hook(linear_input)
        trainer.optimizer.register_step_pre_hook(gradient_dtypes)
        shares = torch.stack([trainer.step(step_batches(cfg, layout, mesh, step)) for step in range(steps)])
        optimizer = trainer.optimizer
        results.append({
            "compute": seen["compute"],
            "grads": sorted(seen["grads"]),
            "params": sorted({str(p.dtype) for p in model.parameters()}),
            "masters": sorted({str(p.dtype) for group in optimizer.param_groups for p in group["params"]}),
            "optimizer_state": sorted({str(t.dtype) for state in optimizer.state.values()
                                       for key, t in state.items() if key != "step"}),
            "losses": global_losses(shares, mesh),
            "buffers": sorted({str(group.grads.dtype) for group in getattr(trainer.dp, "groups", [])}),
        })
    return results


def local_attention_shapes(layouts: list[str]) -> list[dict]:
    """This rank's local shapes of layer 0's attention weights, per layout."""
    cfg = load_model(MODEL)
    results = []
    for text in layouts:
        layout = resolve(text, cfg, dist.get_world_size())
        mesh = mesh_for(layout, "cpu")
        with torch.device("meta"):
            model = Transformer(cfg)
        parallelize_stage(model, layout, mesh, cfg)
        attention = model.layers["0"].attention
        results.append({name: list(local(getattr(attention, name).weight).shape)
                        for name in ("wq", "wk", "wv", "wo")})
    return results


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def held_state_and_peak(layouts: list[str]) -> list[dict]:
    """Per layout, on this rank after one training step: bytes of the parameters and the
    optimizer state it holds, and MemTracker's peak over a second step."""
    results = []
    for text in layouts:
        cfg, layout, mesh, trainer = trainer_for(text)
        trainer.step(step_batches(cfg, layout, mesh, 0))
        params = storage_bytes(local(p) for p in trainer.model.parameters())
        state = storage_bytes(local(t) for per_param in trainer.optimizer.state.values()
                              for t in per_param.values() if torch.is_tensor(t))
        tracker = MemTracker()
        tracker.track_external(trainer.model, trainer.optimizer)
        with tracker:
            trainer.step(step_batches(cfg, layout, mesh, 1))
        results.append({"params": params, "optimizer": state,
                        "peak": memory_by_kind(tracker.get_tracker_snapshot("peak"))})
    return results


def activation_bytes(layouts: list[str]) -> list[int]:
    """Per layout, the activation bytes this rank holds at the end of one micro-batch's
    forward (what the backward will need), measured by torch's MemTracker."""
    results = []
    for text in layouts:
        cfg, layout, mesh, trainer = trainer_for(text)
        inputs, labels = step_batches(cfg, layout, mesh, 0)[0]
        trainer.step([(inputs, labels)])  # optimizer state and FSDP buffers exist from here on
        tracker = MemTracker()
        tracker.track_external(trainer.model, trainer.optimizer)
        with tracker:
            loss = cross_entropy(trainer.model(inputs), labels)
            held = memory_by_kind(tracker.get_tracker_snapshot("current"))
        loss.backward()  # untracked, but run: FSDP expects every forward to meet its backward
        results.append(held["Activation"])
    return results


def zero_one_against_adamw(shapes: list[list[int]], bucket_elements: int, steps: int = 3) -> dict:
    """zero 1's DataParallel over all ranks and torch's fused AdamW in one process, fed the
    same parameters and gradients (each rank's gradient is g, so the reduced one is g):
    the largest difference of the parameters after `steps` steps, and the number of
    elements of Adam state this rank holds."""
    from torch.distributed.device_mesh import init_device_mesh

    from autotune.runtime.parallel import ddp

    ddp.BUCKET_ELEMENTS = bucket_elements  # several buckets even for tiny tensors
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)  # the same numbers on every rank
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]
    sliced = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in start])
    whole = [torch.nn.Parameter(t.clone()) for t in start]
    options = {"lr": 0.1, "betas": (0.9, 0.95), "weight_decay": 0.1}
    data_parallel = ddp.DataParallel([sliced], lambda: [(list(sliced), mesh, mesh)], divisor=dist.get_world_size(),
                                     tp=1, compute_dtype=torch.float32, **options)
    adamw = torch.optim.AdamW(whole, fused=True, **options)
    for step_grads in grads:
        data_parallel.before_microbatch(last=True)
        sum((p * g).sum() for p, g in zip(sliced, step_grads)).backward()
        data_parallel.finish_backward()
        for b, g in zip(whole, step_grads):
            b.grad = g.clone()
        data_parallel.optimizer.step()
        adamw.step()
        data_parallel.optimizer.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
    return {
        "max_difference": max((a - b).abs().max().item() for a, b in zip(sliced, whole)),
        "state_elements": sum(s["exp_avg"].numel() for s in data_parallel.optimizer.state.values()),
        "grads_left": sum(p.grad is not None for p in sliced),
    }


class SavedActivations:
    """Bytes of the tensors autograd saves for backward that are alive at once, and the
    most of them over a step: the activations a rank holds. Storages are counted once
    each, from their packing until Python frees them; parameters' storages (which
    autograd saves too, for the weight gradients' inputs) are not activations.

    Blind inside sequence parallel's halves: their own saved-tensor hooks
    (runtime/parallel/sp_saved.py) are the innermost while they run, and autograd calls
    only those. Measure SP layouts by the allocator (a trial's peak) instead."""

    def __init__(self, modules):
        self.parameters = {local(p).untyped_storage()._cdata for m in modules for p in m.parameters()}
        self.alive: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self.parameters and key not in self.alive:
            self.alive[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self.release, key)
        return tensor

    def release(self, key: int) -> None:
        self.now -= self.alive.pop(key, 0)

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


def pipeline_activation_peaks(cases: list[tuple[str, int]]) -> list[int]:
    """Per (layout, global batch size): this rank's peak bytes of saved activations over
    one training step (the second: the first also infers the stages' shapes)."""
    results = []
    for text, global_batch in cases:
        cfg = dataclasses.replace(load_model(MODEL), global_batch_size=global_batch)
        layout = resolve(text, cfg, dist.get_world_size())
        mesh = mesh_for(layout, "cpu")
        trainer = build_trainer(cfg, layout, mesh, torch.device("cpu"),
                                TrialSpec(model=dataclasses.asdict(cfg), layout=text))
        trainer.step(step_batches(cfg, layout, mesh, 0))
        with SavedActivations(model_parts(trainer)) as saved:
            trainer.step(step_batches(cfg, layout, mesh, 1))
        results.append(saved.peak)
    return results
