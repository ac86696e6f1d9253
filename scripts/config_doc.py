#!/usr/bin/env python3
"""Writes the key tables of docs/config.md from the schemas tidal checks a
config with, so the reference lists every key tidal accepts and cannot drift.

    python scripts/config_doc.py          # rewrites the tables in docs/config.md
    python scripts/config_doc.py --check  # exit 1 when docs/config.md is not current

The tables sit between `<!-- BEGIN keys -->` and `<!-- END keys -->`; the
prose around them is written by hand. Sources: tidal.config.SCHEMA (tidal's
keys and DeepSpeed's, merged from tidal._deepspeed_keys), what tidal does with
each DeepSpeed key it does not act on (NOT_HONOURED, NOT_HONOURED_ERRORS,
REMOVED), tidal.dtr.CONFIG_SCHEMA, tidal.recompute.CONFIG_KEYS,
tidal.data_parallel.SCHEMA and tidal.lr_schedules.PARAMS.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tidal import _deepspeed_keys as ds
from tidal import config as cfg
from tidal import data_parallel, dtr, lr_schedules
from tidal import recompute
from tidal._schema import NONE, Rule

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
BEGIN, END = "<!-- BEGIN keys -->", "<!-- END keys -->"
_DS_DOC = "DeepSpeed's; see the warning tidal gives"


def kind_text(kind: Any) -> str:
    if isinstance(kind, Rule):
        return kind.allowed
    if kind == "bytes":
        return "bytes (an integer or a size such as \"5GB\")"
    if kind is dict:
        return "object"
    if isinstance(kind, tuple) and kind and all(isinstance(k, str) for k in kind):
        return " or ".join(f"`{k}`" for k in kind)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {bool: "bool", int: "int", float: "number", str: "string", list: "list", tuple: "list",
             dict: "object", NONE: "null"}
    out: list[str] = []
    for k in kinds:
        name = names.get(k, getattr(k, "__name__", str(k)))
        if name not in out:
            out.append(name)
    if out[:2] in (["number", "int"], ["int", "number"]):
        out = ["number"] + out[2:]
    return " or ".join(out)


def default_text(value: Any) -> str:
    if value is lr_schedules.REQUIRED:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value >> 20}MiB`"
    try:
        text = json.dumps(value)
    except TypeError:
        text = repr(value)
    return f"`{text}`"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def leaves(schema: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], tuple]]:
    out = []
    for key, spec in schema.items():
        if isinstance(spec, dict):
            out += leaves(spec, prefix + (key,))
        else:
            out.append((prefix + (key,), spec))
    return out


# DeepSpeed keys whose handling depends on the rest of the config
# (tidal.config.Config._deepspeed_values, _zero, _optimizer).
SPECIAL = {
    ("communication_data_type",): "honoured when null or the parameters' dtype; another dtype: "
                                  "warning (tidal reduces gradients in the parameters' dtype)",
    ("gradient_allreduce_op",): "`mean` honoured; `sum`: an error with data-parallel ranks, a "
                                "warning in one process",
    ("optimizer", "params", "amsgrad"): "true: an error (tidal's Adam has no AMSGrad variant)",
    ("optimizer", "params", "maximize"): "true: an error (tidal's Adam minimizes the loss)",
    ("optimizer", "params", "decoupled_weight_decay"): "torch.optim.Adam's own decoupled-decay "
                                                       "switch: honoured with torch_adam and type Adam",
    ("zero_optimization", "offload_optimizer", "device"): "`nvme`: honoured, the fp32 master and "
                                                          "Adam's moments may go to a file in "
                                                          "nvme_path when the host budget is full "
                                                          "(docs/nvme.md); `cpu` "
                                                          "picks the optimizer class DeepSpeed would "
                                                          "build (DeepSpeedCPUAdam), whose defaults "
                                                          "tidal follows",
    ("zero_optimization", "offload_param", "device"): "`nvme`: honoured, the 16-bit parameters may go "
                                                      "to the NVMe tier too (the same nvme_path as "
                                                      "offload_optimizer's; docs/nvme.md)",
    ("zero_optimization", "offload_optimizer", "nvme_path"): "honoured with device `nvme`: the "
                                                             "existing folder on a disk for the NVMe "
                                                             "tier's file",
    ("zero_optimization", "offload_param", "nvme_path"): "honoured with device `nvme`: the same "
                                                         "folder as offload_optimizer's",
    ("zero_optimization", "offload_optimizer", "pipeline_read"): "with device `nvme`: always on "
                                                                 "(no warning)",
    ("zero_optimization", "offload_optimizer", "pipeline_write"): "with device `nvme`: always on "
                                                                  "(no warning)",
    ("zero_optimization", "cpu_offload"): "true is read as offload_optimizer.device `cpu`",
    ("zero_optimization", "offload_optimizer", "pin_memory"): "honoured: false leaves host chunks "
                                                              "unpinned (true pins those that cross "
                                                              "the link again and again)",
    ("zero_optimization", "offload_param", "pin_memory"): "honoured: false leaves host chunks unpinned "
                                                          "(true pins those that cross the link "
                                                          "again and again)",
}


def deepspeed_fate() -> dict[tuple[str, ...], str]:
    """What tidal does with each DeepSpeed key it does not act on."""
    fate: dict[tuple[str, ...], str] = dict(SPECIAL)
    for row in ds.NOT_HONOURED:
        if row.path in fate:
            fate[row.path] += f"; otherwise a warning: {row.what}"
        else:
            fate[row.path] = f"warning: not used by tidal: {row.what}"
    for path, _, what in ds.NOT_HONOURED_ERRORS:
        fate[path] = f"error: {what}"
    return fate


def table(rows: list[tuple[str, str, str, str]], head=("key", "type", "default", "meaning")) -> str:
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def generate() -> str:
    fate = deepspeed_fate()
    tidal_paths = {p for p, _ in leaves(cfg._TIDAL_SCHEMA)}
    out: list[str] = []

    def section(title: str, rows: list[tuple[str, str, str, str]], head=("key", "type", "default", "meaning")):
        out.append(f"### {title}\n\n{table(rows, head)}\n")

    top_tidal, top_ds = [], []
    for path, (kind, default, doc) in leaves(cfg.SCHEMA):
        if path[0] == "tidal" or path[0] in ("optimizer", "fp16", "bf16", "bfloat16", "scheduler",
                                               "activation_checkpointing", "zero_optimization"):
            continue
        name = ".".join(path)
        if path in tidal_paths:
            top_tidal.append((f"`{name}`", kind_text(kind), default_text(default), doc))
        else:
            what = fate.get(path, doc if doc != _DS_DOC else "accepted")
            top_ds.append((f"`{name}`", kind_text(kind), default_text(default), what))
    section("Top level: batch sizes, clipping, logging", top_tidal)

    def block(name: str, title: str, head=("key", "type", "default", "meaning")) -> None:
        rows = []
        for path, (kind, default, doc) in leaves(cfg.SCHEMA[name], (name,)):
            if path in tidal_paths and not (path in fate):
                meaning = doc
            else:
                meaning = fate.get(path, doc if doc != _DS_DOC else "accepted")
            rows.append((f"`{'.'.join(path)}`", kind_text(kind), default_text(default), meaning))
        section(title, rows, head)

    block("optimizer", "`optimizer`")
    block("fp16", "`fp16`")
    block("bf16", "`bf16`")
    block("bfloat16", "`bfloat16` (DeepSpeed's old name of `bf16`, read only when `bf16` is absent)")
    sched = []
    for kind_name, params in lr_schedules.PARAMS.items():
        for key, (kind, default, doc) in params.items():
            sched.append((f"`{kind_name}`", f"`{key}`", kind_text(kind), default_text(default), doc))
    out.append("### `scheduler`\n\n`scheduler.type` is one of " +
               ", ".join(f"`{k}`" for k in lr_schedules.PARAMS) + " (default none: a constant "
               "learning rate); `scheduler.params` takes that type's parameters:\n\n" +
               table(sched, ("scheduler.type", "params key", "type", "default", "meaning")) + "\n")
    rc = [(f"`activation_checkpointing.{k}`", kind_text(spec[0]), default_text(spec[1]), spec[2])
          for k, spec in recompute.CONFIG_KEYS.items() if k in cfg.SCHEMA["activation_checkpointing"]]
    section("`activation_checkpointing` (DeepSpeed's keys, interpreted by tidal.recompute)", rc)

    t = []
    for path, (kind, default, doc) in leaves(cfg.SCHEMA["tidal"], ("tidal",)):
        t.append((f"`{'.'.join(path)}`", kind_text(kind), default_text(default), doc))
    section("`tidal`", t)
    under_engine = {
        "eviction_threshold": " (none of its own: under the engine DTR's threshold is the budget "
                              "less the margin less the chunks held on the device)",
        "evictee_minimum_size": " ((budget - margin) / 1024 under the engine, within 4 KiB..1 MiB: "
                                "Note [DTR's defaults under the engine])",
    }
    d = [(f"`tidal.dtr.{k}`", kind_text(kind),
          (default_text(default) if default is not None else default_text(dtr._options[k])) +
          under_engine.get(k, ""), doc) for k, (kind, default, doc) in dtr.CONFIG_SCHEMA.items()]
    section("`tidal.dtr` (DTR of activations under the engine, docs/dtr.md)", d)
    r = [(f"`tidal.recompute.{k}`", kind_text(spec[0]), default_text(spec[1]), spec[2])
         for k, spec in recompute.CONFIG_KEYS.items() if k not in cfg.SCHEMA["activation_checkpointing"]]
    section("`tidal.recompute` (tidal's recompute keys, docs/recompute.md)", r)
    p = [(f"`tidal.data_parallel.{k}`", kind_text(kind), default_text(default), doc)
         for k, (kind, default, doc) in data_parallel.SCHEMA.items()]
    section("`tidal.data_parallel` (docs/data_parallel.md)", p)

    head = ("key", "type", "DeepSpeed's default", "what tidal does")
    section("DeepSpeed's top-level keys", top_ds, head)
    z = [(f"`{'.'.join(path)}`", kind_text(kind), default_text(default),
          fate.get(path, doc if doc != _DS_DOC else "accepted"))
         for path, (kind, default, doc) in leaves(cfg.SCHEMA["zero_optimization"], ("zero_optimization",))]
    section("`zero_optimization`", z, head)
    gone = [(f"`{k}`", what) for k, what in {**ds.REMOVED, **cfg._REJECTED}.items()]
    out.append("### Keys that are errors\n\nDeepSpeed 0.19.8 rejects these too:\n\n" +
               table(gone, ("key", "what it was / what to write instead")) + "\n")
    unread = [(f"`{k}`", what) for k, what in ds.NOT_READ_BY_DEEPSPEED.items()]
    out.append("### Keys DeepSpeed does not read\n\nAccepted with a warning:\n\n" +
               table(unread, ("key", "what tidal does")) + "\n")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    try:
        start = text.index(BEGIN) + len(BEGIN)
        end = text.index(END)
    except ValueError:
        print(f"{DOC}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    new = text[:start] + "\n" + generate() + "\n" + text[end:]
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is not current: run python scripts/config_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
