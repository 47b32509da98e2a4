"""The tiny model of the DeepSpeed checkpoint fixtures, shared by the script
that makes them (run under DeepSpeed) and the tests that import them (dsrun)."""
import torch
from torch import nn

VOCAB, WIDTH, HIDDEN, SEQ = 16, 8, 12, 6


class TinyNet(nn.Module):
    """Embedding -> Linear -> LayerNorm -> GELU -> Linear (logits), a persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.fc = nn.Linear(WIDTH, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, idx, target):
        h = self.norm(self.fc(self.embed(idx)))
        logits = self.head(torch.nn.functional.gelu(h) * self.scale[0])
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, rank: int, size: int = 2):
    """(idx, target) of micro-batch `step` on `rank`: (size, SEQ) int64 each."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return idx, torch.roll(idx, 1, dims=1)
