"""The request state machine."""

from __future__ import annotations

import pytest

from tokenmill.errors import InvalidStateTransition
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams

S = RequestStatus


def _request() -> Request:
    return Request(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams())


@pytest.mark.parametrize("path", [
    [S.RUNNING, S.FINISHED_STOPPED],
    [S.RUNNING, S.PREEMPTED, S.RUNNING, S.FINISHED_LENGTH],
    [S.WAITING_FOR_GRAMMAR, S.WAITING, S.RUNNING, S.FINISHED_ABORTED],
    [S.WAITING_FOR_REMOTE_KVS, S.WAITING, S.FINISHED_TIMEOUT],
    [S.FINISHED_ABORTED],
    [S.RUNNING, S.PREEMPTED, S.FINISHED_ERROR],
])
def test_valid_paths(path):
    request = _request()
    for status in path:
        request.transition(status)
    assert request.status == path[-1]


@pytest.mark.parametrize(("path", "bad"), [
    ([S.RUNNING, S.FINISHED_STOPPED], S.FINISHED_ABORTED),  # cancelling a finished request
    ([], S.PREEMPTED),
    ([S.RUNNING], S.WAITING),
    ([S.RUNNING, S.PREEMPTED], S.WAITING_FOR_GRAMMAR),
    ([S.WAITING_FOR_GRAMMAR], S.RUNNING),
    ([S.FINISHED_LENGTH], S.RUNNING),
])
def test_invalid_transitions_raise(path, bad):
    request = _request()
    for status in path:
        request.transition(status)
    with pytest.raises(InvalidStateTransition, match=f"{path[-1].name if path else 'WAITING'} to {bad.name}"):
        request.transition(bad)
    assert request.status == (path[-1] if path else S.WAITING)


def test_finished_statuses_and_reasons():
    assert [s for s in S if s.is_finished] == [S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.FINISHED_ABORTED,
                                               S.FINISHED_ERROR, S.FINISHED_TIMEOUT]
    assert S.FINISHED_STOPPED.finish_reason == "stop" and S.FINISHED_LENGTH.finish_reason == "length"
    assert S.RUNNING.finish_reason is None
