"""`autotune models [PATH...] [--json]`: what each model file (or every preset) describes.

Plain text, not a terminal-sized table: a name is what a user types back into
`--model`, so it is never cut or wrapped, in a narrow terminal or in a pipe.
"""

from __future__ import annotations

import json

from autotune.config import ModelConfig, load_model, model_presets

COLUMNS = ("name", "params", "active_params", "layers", "hidden", "attention", "mlp", "moe", "rope_theta", "dtype")


def add_models_parser(sub) -> None:
    """`autotune models [PATH...] [--json]`"""
    p = sub.add_parser("models", help="describe model files (YAML or config.json), or every preset")
    p.add_argument("paths", nargs="*", metavar="PATH", help="model files or preset names (default: every preset)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    p.set_defaults(func=cmd_models)


def describe(m: ModelConfig) -> dict:
    attention = m.attention if m.attention == "mla" else f"gqa {m.num_heads}/{m.num_kv_heads}x{m.head_dim}"
    if m.qk_norm:
        attention += " qk-norm"
    if m.sliding_window is not None:
        layers = "all" if m.sliding_window_layers is None else len(m.sliding_window_layers)
        attention += f" window {m.sliding_window} ({layers} layers)"
    moe = None
    if m.moe is not None:
        moe = f"top-{m.moe.top_k} of {m.moe.num_experts}"
        if m.moe.num_shared_experts:
            moe += f" +{m.moe.num_shared_experts} shared"
        if m.num_moe_layers < m.num_layers:
            moe += f" in {m.num_moe_layers} layers"
    return {"name": m.name, "params": m.num_params(), "active_params": m.num_active_params(),
            "layers": m.num_layers, "hidden": m.hidden_size, "attention": attention, "mlp": m.mlp, "moe": moe,
            "rope_theta": None if m.learned_positions or m.hybrid_pattern else m.rope_theta, "dtype": m.dtype,
            "hybrid_pattern": m.hybrid_pattern}


def human_count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def cmd_models(args) -> int:
    rows = [describe(load_model(spec)) for spec in (args.paths or model_presets())]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cells = [list(COLUMNS)] + [[
        r["name"], human_count(r["params"]), human_count(r["active_params"]), str(r["layers"]), str(r["hidden"]),
        r["attention"], r["mlp"], r["moe"] or "-", "-" if r["rope_theta"] is None else f"{r['rope_theta']:g}",
        r["dtype"]] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0
