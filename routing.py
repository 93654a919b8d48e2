"""The routing rule of a fake step: which experts a mixture of experts' router chooses for each token when the
router's scores are fake tensors (no values). docs/capture.md: Mixtures of experts under --fake.

A rule gives each expert a count of token choices (a router choosing k of E experts for T tokens makes T*k):
- `balanced` (the default): T*k/E each, the first experts one more where it does not divide;
- `worst`: every token chooses the same k experts (0 to k-1), the others get none;
- `loads=W0,W1,...`: expert e gets the share W_e / sum(W) of the choices (one weight per expert), apportioned by
  largest remainder; a share above 1/k is refused, since a token chooses an expert at most once.
The choices are then dealt like cards: expert 0's, then expert 1's, ... are dealt one per token in turn, round
after round (k rounds), the tokens taken position by position across the batch (position 0 of every sequence,
then position 1, ...). So each token gets k different experts and every sequence gets its share of each expert.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memplan.errors import MemplanError

if TYPE_CHECKING:  # torch only where choices are dealt: the command line's start loads no torch
    import torch

RULES = ("balanced", "worst", "loads=W0,W1,...")
DEFAULT = "balanced"


class RoutingError(MemplanError):
    """A routing rule that cannot be read, or that a router cannot follow."""


@dataclass(frozen=True)
class Routing:
    """A routing rule: its name and, for `loads`, one weight per expert."""

    rule: str = DEFAULT
    loads: tuple[float, ...] = ()

    @classmethod
    def parse(cls, text: str | Routing) -> Routing:
        """The rule `text` names (balanced, worst or loads=W0,W1,...); RoutingError in one line otherwise."""
        if isinstance(text, Routing):
            return text
        text = str(text).strip()
        if text in ("balanced", "worst"):
            return cls(text)
        name, _, weights = text.partition("=")
        if name.strip() != "loads" or not weights.strip():
            raise RoutingError(f"--routing {text!r}: choose balanced, worst or loads=W0,W1,... (a weight per expert)")
        try:
            loads = tuple(float(w) for w in weights.split(","))
        except ValueError:
            raise RoutingError(f"--routing {text!r}: the loads are numbers, one per expert, comma-separated") from None
        if any(not math.isfinite(w) or w < 0 for w in loads) or sum(loads) <= 0:
            raise RoutingError(f"--routing {text!r}: the loads are finite, not negative, and not all 0")
        return cls("loads", loads)

    def __str__(self) -> str:
        return f"loads={','.join(f'{w:g}' for w in self.loads)}" if self.rule == "loads" else self.rule

    def applies_to(self, experts: int) -> bool:
        """Whether the rule's own choice applies to a router among `experts` (loads: one weight per expert);
        a router among another number is routed `balanced`."""
        return self.rule != "loads" or len(self.loads) == experts

    def counts(self, tokens: int, k: int, experts: int) -> list[int]:
        """Token choices per expert for a router choosing `k` of `experts` for each of `tokens` tokens."""
        if not 1 <= k <= experts:
            raise RoutingError(f"a router choosing {k} of {experts} experts cannot be routed")
        total = tokens * k
        rule = self.rule if self.applies_to(experts) else DEFAULT
        if rule == "worst":
            return [tokens if e < k else 0 for e in range(experts)]
        shares = [1 / experts] * experts if rule == DEFAULT else [w / sum(self.loads) for w in self.loads]
        for e, share in enumerate(shares):
            if share * k > 1 + 1e-12:
                raise RoutingError(
                    f"--routing {self}: expert {e}'s share {share:.3g} is more than a top-{k} router can give one "
                    f"expert (1/{k}: a token chooses an expert once)"
                )
        quotas = [share * total for share in shares]
        counts = [min(tokens, math.floor(q)) for q in quotas]
        by_remainder = sorted(range(experts), key=lambda e: (-(quotas[e] - counts[e]), e))
        for e in by_remainder[: total - sum(counts)]:
            counts[e] += 1
        return counts

    def choices(self, leading: tuple[int, ...], k: int, experts: int) -> torch.Tensor:
        """The experts chosen for each token of a router whose scores have shape (*leading, experts): an int64
        tensor of shape (*leading, k), dealt as the module docstring says."""
        import torch

        tokens = math.prod(leading)
        counts = self.counts(tokens, k, experts)
        deck = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts, dtype=torch.long))
        dealt = deck.view(k, tokens).t()  # [r, j]: the card dealt to the r-th token in round j
        grid = torch.arange(tokens).view(leading) if leading else torch.arange(tokens)
        order = grid.permute(*reversed(range(grid.dim()))).reshape(-1)  # the r-th token dealt to: position-major
        return dealt[torch.argsort(order)].view(*leading, k)  # row t: the cards of token t
