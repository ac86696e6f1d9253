"""What the engine and checkpoint tests share: data, a training loop under
tidal, and a model used in the reverse of its module order."""
import torch


def gpt_batches(n, vocab=96, seq=8, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g),
             torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(n)]


def train_tidal(engine, batches):
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


class Reversed(torch.nn.Module):
    """Layers built in one order and used in the other: module order is the
    worst guess of the first-use order, so the engine rebuilds its chunks."""

    def __init__(self, width=32, depth=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)
