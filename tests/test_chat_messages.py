"""The one chat-message rule (plait.chat_template.message_problem) that serving's 400s and data preparation's
bad-record errors both word from."""

from __future__ import annotations

import pytest

from plait.chat_template import MessageProblem, message_problem
from plait.data.chat import BadChat, check_messages
from plait.serve.protocol import ApiError
from plait.serve.protocol import check_messages as check_request

USER = {"role": "user", "content": "hi"}
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("messages, problem", [
    (None, MessageProblem(None, None, "null", "NoneType")),
    ([], MessageProblem(None, None, "empty", "list")),
    ("hi", MessageProblem(None, None, "not_a_list", "str")),
    ({"role": "user"}, MessageProblem(None, None, "not_a_list", "dict")),
    ([USER, "hi"], MessageProblem(1, None, "not_an_object", "str")),
    ([USER, {"content": "x"}], MessageProblem(1, "role", "missing", "NoneType")),
    ([{"role": None, "content": "x"}], MessageProblem(0, "role", "null", "NoneType")),
    ([{"role": 3}], MessageProblem(0, "role", "wrong_type", "int")),  # the role is named before the content
    ([USER, {"role": "user"}], MessageProblem(1, "content", "missing", "NoneType")),
    ([{"role": "tool", "content": None}], MessageProblem(0, "content", "null", "NoneType")),
    ([USER, {"role": "assistant"}], MessageProblem(1, "content", "missing", "NoneType")),
    ([{**CALL, "role": "user"}], MessageProblem(0, "content", "missing", "NoneType")),  # tool_calls: assistant only
    ([{**CALL, "tool_calls": []}], MessageProblem(0, "content", "missing", "NoneType")),
    ([USER, CALL], None),
    ([USER, {**CALL, "content": None}], None),
    ([{"role": "assistant", "function_call": {"name": "f"}}], None),
    ([USER, {"role": "assistant", "content": ""}], None)])
def test_message_problem_names_the_first_break_of_the_rule(messages, problem):
    assert message_problem(messages) == problem


def test_serving_and_data_preparation_word_the_same_problem_their_own_way():
    messages = [USER, {"role": 3, "content": "x"}]
    with pytest.raises(ApiError) as api:
        check_request(messages)
    assert (api.value.status, api.value.param, api.value.code) == (400, "messages[1].role", "invalid_type")
    assert "expected a string, but got int instead." in api.value.message
    with pytest.raises(BadChat, match=r"^conversation\[1\]'s role is a JSON int, not a string$"):
        check_messages(messages, "conversation")
    with pytest.raises(BadChat, match=r"^'conversation' is null, not a list of \{role, content\} messages$"):
        check_messages(None, "conversation")
    check_request([USER, CALL])
    check_messages([USER, CALL], "conversation")
