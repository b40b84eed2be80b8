"""Speculative decoding's counts, as vLLM keeps them (vllm/v1/spec_decode/metrics.py), and the speedup
they predict. No torch.

    drafts            verification rounds: steps in which a request had drafted tokens checked
    draft tokens      tokens drafted (k per round, fewer when the proposer found fewer)
    accepted tokens   drafted tokens the target agreed with; per position: the i-th draft of a round
    α                 accepted / drafted (vLLM's "draft acceptance rate")
    mean acceptance length   1 + accepted / drafts: tokens a round gives, the target's own one counted

The prediction is Leviathan et al.'s: with acceptance α, k drafts and c the cost of one draft step
over one target step, a round gives (1 − α^(k+1)) / (1 − α) tokens for the cost of k·c + 1 target steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """(1 − α^(k+1)) / (1 − α): tokens a round yields when each draft is accepted with probability α."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """(1 − α^(k+1)) / ((1 − α)(k·c + 1)): wall-time gain over plain decoding (Leviathan et al. 2023)."""
    return expected_tokens_per_round(alpha, k) / (k * c + 1.0)


@dataclass
class SpecDecodingStats:
    """One request's (or the engine's) speculation, summed over its rounds."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafted_per_pos: list[int] = field(default_factory=list)  # rounds that drafted an i-th token

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One round: `num_draft_tokens` drafted, the first `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for per_pos, n in ((self.num_drafted_per_pos, num_draft_tokens), (self.num_accepted_tokens_per_pos, num_accepted)):
            if len(per_pos) < num_draft_tokens:
                per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
            for i in range(n):
                per_pos[i] += 1

    def merge(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in ((self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                             (self.num_drafted_per_pos, other.num_drafted_per_pos)):  # fmt: skip
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_rate(self) -> float:
        """α: accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (the target's own token counted), vLLM's figure."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_drafted_per_pos)]

    @property
    def mean_draft_length(self) -> float:
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict:
        return dict(
            num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
            acceptance_rate=round(self.acceptance_rate, 6), mean_acceptance_length=round(self.mean_acceptance_length, 6),
            per_position_acceptance_rate=[round(x, 6) for x in self.per_position_acceptance_rate],
        )  # fmt: skip
