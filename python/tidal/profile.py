"""The memory profile of a training step, for users: a PNG of device memory
at every trace point (chunks, non-chunk memory, free, the budget line) with
the chunk moves and evictions marked. Engine.export_memory_profile() writes it
with a JSON of the same points; tidal-train --profile DIR calls that.
"""
from __future__ import annotations

import math

__all__ = ["plot_memory_profile"]


def plot_memory_profile(timeline, path, title: str = "device memory over one training step"):
    """Writes a PNG of device memory at each trace point of one step.

    Args:
        timeline: one entry per trace point in step order: what
            Engine.memory_timeline() returns, (moment, hook, chunk_bytes,
            non_chunk_bytes, budget) tuples, or dicts with those keys, as
            Engine.memory_profile() returns, whose "h2d_moves", "d2h_moves"
            and "evictions" (chunk traffic since the previous point) are
            marked on the plot. chunk_bytes: chunk bytes resident on the
            device; non_chunk_bytes: the peak of everything else
            (activations, workspaces) since the previous point; budget: the
            whole device budget.
        path: the PNG to write.
        title: the figure's title.
    Returns:
        {"points", "peak_chunk_bytes", "peak_non_chunk_bytes", "budget",
        "marked_moves", "marked_evictions"}.
    """
    keys = ("moment", "hook", "chunk_bytes", "non_chunk_bytes", "budget")
    rows = [tuple(p[k] for k in keys) if isinstance(p, dict) else tuple(p) for p in timeline]
    if not rows:
        raise ValueError("the memory timeline is empty: train at least one step before plotting")
    for row in rows:
        if len(row) != 5:
            raise ValueError(f"a timeline entry must be {keys}, got {row!r}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting the memory profile needs matplotlib: pip install matplotlib") from None

    mib = float(1 << 20)
    # One bar per point: the last point gets a width too (step="post" drops it otherwise).
    x = [r[0] for r in rows]
    x = x + [x[-1] + 1]
    chunk = [r[2] / mib for r in rows]
    other = [r[3] / mib for r in rows]
    budget = [r[4] / mib for r in rows]
    free = [max(0.0, b - c - o) for b, c, o in zip(budget, chunk, other)]
    ext = lambda v: v + [v[-1]]  # noqa: E731
    fig, ax = plt.subplots(figsize=(12, 4.8), dpi=100)
    ax.stackplot(x, ext(chunk), ext(other), ext(free), step="post",
                 labels=["chunks (params, grads, Adam states)", "non-chunk (activations, other)",
                         "free"],
                 colors=["#3b75af", "#ef8636", "#d9e8d3"])
    ax.step(x, ext(budget), where="post", color="black", linewidth=1.2, label="device budget")
    # Phase boundaries: forward, backward (module or gradient hooks), the optimizer step.
    hooks = [str(r[1]) for r in rows]
    kinds = [h.split(" ")[0] for h in hooks]
    top = max(max(budget), max(c + o for c, o in zip(chunk, other))) * 1.1
    for names, label in ((("fwd",), "forward"), (("bwd", "grad"), "backward"),
                         (("step",), "optimizer step")):
        first = next((r[0] for r, k in zip(rows, kinds) if k in names), None)
        if first is not None:
            ax.axvline(first, color="grey", linestyle="--", linewidth=0.8)
            end = label == "optimizer step"
            ax.text(first, top * 0.985, f"{label} " if end else f" {label}", fontsize=8,
                    va="top", ha="right" if end else "left")
    # Chunk traffic: a tick per interval with moves (up: host->device, down:
    # device->host) and a cross per eviction interval, at the top edge.
    traffic = [(r[0], p.get("h2d_moves", 0), p.get("d2h_moves", 0), p.get("evictions", 0))
               for r, p in zip(rows, timeline) if isinstance(p, dict)]
    marked_moves = marked_evictions = 0
    if traffic:
        up = [(k + 0.5, top * 0.93) for k, h, _, _ in traffic if h]
        down = [(k + 0.5, top * 0.90) for k, _, d, _ in traffic if d]
        ev = [(k + 0.5, top * 0.87) for k, _, _, e in traffic if e]
        for pts, marker, color, label in ((up, "^", "#1f4e79", "chunk moves host->device"),
                                          (down, "v", "#7f3f00", "chunk moves device->host"),
                                          (ev, "x", "#b00020", "evictions")):
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, s=14,
                           color=color, label=label, zorder=3)
        marked_moves = sum(h + d for _, h, d, _ in traffic)
        marked_evictions = sum(e for *_, e in traffic)
    n = len(rows)
    every = max(1, math.ceil(n / 24))
    ax.set_xticks([v + 0.5 for v in x[:-1][::every]])
    ax.set_xticklabels([h if len(h) <= 28 else h[:27] + "…" for h in hooks[::every]],
                       rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_xlabel("trace point (module hook) in step order")
    ax.set_title(title)
    ax.set_ylim(0, top)
    ax.set_xlim(x[0], x[-1])
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return {"points": n, "peak_chunk_bytes": max(r[2] for r in rows),
            "peak_non_chunk_bytes": max(r[3] for r in rows), "budget": max(r[4] for r in rows),
            "marked_moves": marked_moves, "marked_evictions": marked_evictions}
