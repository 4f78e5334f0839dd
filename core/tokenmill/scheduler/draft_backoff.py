"""An automatic off-switch for speculation: a request whose recent drafts the target keeps
rejecting stops carrying drafts for a while, then tries again.

Verifying a draft costs a token of the step's forward and a row of logits whether or not it
is accepted; where drafts rarely hit (n-gram lookup on text that does not repeat, a draft
model far from the target) they only cost. Each request is judged by its own last
``window`` draft tokens: below ``min_acceptance_rate`` accepted, it decodes its next
``pause`` tokens without drafts, and is judged afresh after. Requests whose drafts hit keep
them, in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftBackoff:
    min_acceptance_rate: float = 0.0  # 0: never switch off
    window: int = 32  # draft tokens judged at a time
    pause: int = 32  # output tokens decoded without drafts before trying again
    num_pauses: int = 0  # since start
    _drafted: dict[str, int] = field(default_factory=dict)
    _accepted: dict[str, int] = field(default_factory=dict)
    _paused_until: dict[str, int] = field(default_factory=dict)  # request -> its output length then

    def record(self, req_id: str, num_drafted: int, num_accepted: int, num_output_tokens: int) -> None:
        """The target verified ``num_drafted`` drafts of the request and accepted ``num_accepted``."""
        if self.min_acceptance_rate <= 0:
            return
        drafted = self._drafted.get(req_id, 0) + num_drafted
        accepted = self._accepted.get(req_id, 0) + num_accepted
        if drafted < self.window:
            self._drafted[req_id], self._accepted[req_id] = drafted, accepted
            return
        self._drafted.pop(req_id, None)
        self._accepted.pop(req_id, None)
        if accepted < self.min_acceptance_rate * drafted:
            self._paused_until[req_id] = num_output_tokens + self.pause
            self.num_pauses += 1

    def allows(self, req_id: str, num_output_tokens: int) -> bool:
        """Whether the request may carry drafts into its next step."""
        until = self._paused_until.get(req_id)
        if until is None:
            return True
        if num_output_tokens < until:
            return False
        del self._paused_until[req_id]
        return True

    def forget(self, req_id: str) -> None:
        for table in (self._drafted, self._accepted, self._paused_until):
            table.pop(req_id, None)
