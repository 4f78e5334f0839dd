"""An automatic off-switch for speculation: a request whose recent drafts the target keeps
rejecting is not drafted for a while, then tried again.

Verifying a draft costs a token of the step's forward and a row of logits whether or not it
is accepted, and drafting it costs the proposer's work (a draft model's steps); where drafts
rarely hit (n-gram lookup on text that does not repeat, a draft model far from the target)
they only cost. Each request is judged by its own last ``window`` draft tokens (sooner when the verdict is
already certain), because
acceptance follows what a request writes (a request repeating a text beside one that does
not): below ``min_acceptance_rate`` accepted (by default the break-even rate of
``spec_decode/cost.py``), it decodes its next ``pause`` tokens without drafts, and the
workers' proposer is not asked for its drafts meanwhile (``SchedulerOutput.no_draft_req_ids``),
so both costs go. Then it drafts again and is judged afresh; each low judgement in a row
doubles its pause, up to ``MAX_PAUSE_DOUBLINGS`` doublings, and a judgement that passes resets it.
Requests whose drafts hit keep them, in the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_PAUSE_DOUBLINGS = 4  # a pause grows to 16 times ``pause`` at most


@dataclass
class DraftBackoff:
    min_acceptance_rate: float = 0.0  # 0: never switch off
    window: int = 32  # draft tokens judged at a time
    pause: int = 32  # output tokens decoded without drafts before trying again (the first time)
    num_pauses: int = 0  # requests switched off, since start (a request again after each low judgement)
    num_paused_steps: int = 0  # request steps that went without drafts because of a pause, since start
    _drafted: dict[str, int] = field(default_factory=dict)
    _accepted: dict[str, int] = field(default_factory=dict)
    _paused_until: dict[str, int] = field(default_factory=dict)  # request -> its output length then
    _low_in_a_row: dict[str, int] = field(default_factory=dict)  # request -> its low judgements in a row

    def record(self, req_id: str, num_drafted: int, num_accepted: int, num_output_tokens: int) -> None:
        """The target verified ``num_drafted`` drafts of the request and accepted ``num_accepted``."""
        if self.min_acceptance_rate <= 0:
            return
        drafted = self._drafted.get(req_id, 0) + num_drafted
        accepted = self._accepted.get(req_id, 0) + num_accepted
        # judged once the window is full, or sooner where accepting every draft left in it could
        # no longer lift it to the rate (a draft model's higher rate: its probes end early)
        decided = accepted + (self.window - drafted) < self.min_acceptance_rate * self.window
        if drafted < self.window and not decided:
            self._drafted[req_id], self._accepted[req_id] = drafted, accepted
            return
        self._drafted.pop(req_id, None)
        self._accepted.pop(req_id, None)
        if accepted >= self.min_acceptance_rate * drafted:
            self._low_in_a_row.pop(req_id, None)
            return
        doublings = min(self._low_in_a_row.get(req_id, 0), MAX_PAUSE_DOUBLINGS)
        self._low_in_a_row[req_id] = doublings + 1
        self._paused_until[req_id] = num_output_tokens + (self.pause << doublings)
        self.num_pauses += 1

    def is_paused(self, req_id: str, num_output_tokens: int) -> bool:
        """Whether the request, at this output length, is still paused (asks nothing to change)."""
        until = self._paused_until.get(req_id)
        return until is not None and num_output_tokens < until

    def allows(self, req_id: str, num_output_tokens: int) -> bool:
        """Whether the request may carry drafts into its next step (a refusal counts a paused step)."""
        if self.is_paused(req_id, num_output_tokens):
            self.num_paused_steps += 1
            return False
        self._paused_until.pop(req_id, None)
        return True

    def forget(self, req_id: str) -> None:
        for table in (self._drafted, self._accepted, self._paused_until, self._low_in_a_row):
            table.pop(req_id, None)
