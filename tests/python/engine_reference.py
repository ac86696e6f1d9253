"""What the engine tests share: the reference (plain PyTorch with
torch.optim.AdamW), the engine's config at a small budget, and the check that
an engine's losses and fp32 masters agree with the reference's."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget  # noqa: E402

LR = 2e-3


def config(budget="600KiB", chunk=16384, **tidal_keys):
    t = {"chunk_size": chunk, "device_memory_budget": budget, "device_margin": 1024}
    t.update(tidal_keys)
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "tidal": t}


def fitted(cfg, model, batches):
    """`cfg` with a device budget measured on this machine (engine_helpers.measured_budget)."""
    cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches)
    return cfg


def train_reference(model, batches, clip=0.0, accumulation=1, norms=None):
    """Plain PyTorch: torch.optim.AdamW, torch.nn.utils.clip_grad_norm_ when
    `clip`; `norms`, a list, gets each step's gradient norm before clipping."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                            weight_decay=0.01)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            elif norms is not None:
                norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                      if p.grad is not None])
            if norms is not None:
                norms.append(norm.item())
            opt.step()
            opt.zero_grad()
    return losses


def assert_close(engine, ref, ref_losses, losses, rtol=1e-5):
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= rtol * abs(a), (ref_losses, losses)
    weights = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        got = weights[name]
        err = (got - p.detach()).norm() / p.detach().norm().clamp_min(1e-12)
        assert err <= rtol, f"{name}: relative L2 error {err:.3g}"


def assert_clip_fires(norms, clip, fires):
    """The reference's gradient norms put `clip` where the case says: above
    them all ("never"), or between them ("some": clips on some steps, and on
    others leaves the gradients as they are, where min(1, ...) caps the factor)."""
    clipped = [n > clip for n in norms]
    if fires == "never":
        assert not any(clipped), (clip, norms)
    else:
        assert any(clipped) and not all(clipped), (clip, norms)
