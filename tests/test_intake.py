"""What a request is checked against before it reaches the scheduler, and what a served
request is converted from: values beyond what the engine's tensors and the pools' messages
carry (64-bit ids, a top-k or log-prob count beyond the vocabulary, fields of the wrong type)
are refused with the field and the value, never raised inside a step."""

from __future__ import annotations

import pytest

from tknp_megatron.config import get_preset
from tknp_megatron.engine.intake import request_problem
from tknp_megatron.engine.request import Request, RequestTimeline
from tknp_megatron.sampling import SamplingParams

TINY = get_preset("tiny")  # vocabulary 512, 1024 positions


def _problem(prompt, **params):
    req = Request(7, list(prompt), SamplingParams(**params), RequestTimeline(release=0.0))
    return request_problem(req, TINY, max_fit_tokens=1024)


@pytest.mark.parametrize("prompt, bad", [([1, 2**63], 2**63), ([1, 2**64 + 5], 2**64 + 5), ([-(2**70), 3], -(2**70)),
                                         ([3, 512], 512), ([-1], -1)])
def test_token_ids_outside_the_vocabulary_are_named_whatever_their_size(prompt, bad):
    assert _problem(prompt) == f"request 7: token id {bad} outside the vocabulary [0, 512)"


def test_integer_ids_take_integers_of_every_kind_and_round_none():
    import numpy as np
    import torch

    from tknp_megatron.engine.intake import integer_ids

    assert integer_ids([1, np.int64(2), torch.tensor(3)]) == ([1, 2, 3], None)
    assert integer_ids(torch.tensor([4, 5])) == ([4, 5], None)
    assert integer_ids(iter([6, 7])) == ([6, 7], None)
    assert integer_ids([1, 2.7, 3]) == ([], 2.7)
    ids, bad = integer_ids(torch.tensor([1.5, 2.0]))
    assert ids == [] and float(bad) == 1.5


def test_top_n_logprobs_beyond_the_vocabulary_is_refused():
    assert _problem([1, 2], return_log_probs=True, top_n_logprobs=512) is None
    assert _problem([1, 2], return_log_probs=True, top_n_logprobs=513) == (
        "request 7: top_n_logprobs 513 exceeds the vocabulary (512 tokens)")


def test_prompt_log_probs_need_log_probs_and_a_prompt_prefilled_in_the_pool():
    import torch

    with pytest.raises(ValueError, match="return_prompt_log_probs needs return_log_probs"):
        SamplingParams(return_prompt_log_probs=True)
    params = SamplingParams(return_log_probs=True, return_prompt_log_probs=True)
    assert _problem([1, 2, 3], return_log_probs=True, return_prompt_log_probs=True) is None
    ingested = Request(7, [1, 2, 3], params, RequestTimeline(release=0.0),
                       kv=torch.zeros(TINY.num_layers, 2, 2, TINY.num_query_groups, TINY.kv_channels))
    assert request_problem(ingested, TINY, max_fit_tokens=1024) == (
        "request 7: return_prompt_log_probs needs the prompt prefilled in the pool; its KV comes from outside")


def test_a_served_echo_with_log_probs_asks_for_the_prompts():
    """Megatron's completions endpoint sends ``skip_prompt_log_probs`` False for ``echo`` with
    ``logprobs``; the chat endpoint's are skipped (the front end sets it)."""
    from tknp_megatron.serving.megatron_types import to_engine_request

    def params(**fields):
        return to_engine_request([1, 2, 3], {"num_tokens_to_generate": 4, **fields}, tokenizer=None,
                                 max_sequence_length=1024).params

    assert params(return_log_probs=True, skip_prompt_log_probs=False).return_prompt_log_probs
    assert not params(return_log_probs=True, skip_prompt_log_probs=True).return_prompt_log_probs
    assert not params(return_log_probs=False, skip_prompt_log_probs=False).return_prompt_log_probs


@pytest.mark.parametrize("field, value", [("top_k", 2**63), ("eos_id", 2**63)])
def test_sampling_fields_beyond_64_bits_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be .*got {value}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("params, message", [
    (dict(num_tokens_to_generate="abc"), "num_tokens_to_generate 'abc': expected a whole number"),
    (dict(num_tokens_to_generate=2.5), "num_tokens_to_generate 2.5: expected a whole number"),
    (dict(termination_id=[1]), "termination_id [1]: expected a whole number"),
    (dict(top_n_logprobs="x", return_log_probs=True, skip_prompt_log_probs=True),
     "top_n_logprobs 'x': expected a whole number"),
    (dict(top_k=2**63, temperature=1.0), "top_k must be in [0, 2**63), got 9223372036854775808"),
    (dict(termination_id=2**63), "eos_id must be None or in [0, 2**63), got 9223372036854775808"),
    (dict(num_tokens_total=12), "num_tokens_to_generate 4 and num_tokens_total 12: set one (the other None)"),
    (dict(num_tokens_to_generate=None, num_tokens_total=3), "num_tokens_total 3: must exceed the prompt's 3 tokens"),
    (dict(return_log_probs=True, skip_prompt_log_probs=True, top_n_logprobs=2, return_prompt_top_n_logprobs=True),
     "sampling parameters Megatron's SamplingParams refuses: return_prompt_top_n_logprobs requires "
     "skip_prompt_log_probs to be False"),
], ids=["tokens_str", "tokens_fraction", "termination_list", "top_n_str", "top_k_64_bits", "termination_64_bits",
        "both_lengths", "total_within_prompt", "megatron_refuses"])
def test_served_fields_of_the_wrong_type_or_size_are_refused_by_name(params, message):
    """Megatron's ``InferenceClient`` sends its ``SamplingParams`` as they are: the pool
    refuses what the engine cannot take, naming the field."""
    from tknp_megatron.serving.megatron_types import RequestRefused, to_engine_request

    with pytest.raises(RequestRefused) as err:
        to_engine_request([1, 2, 3], {"num_tokens_to_generate": 4, **params}, tokenizer=None,
                          max_sequence_length=1024)
    assert message in str(err.value)


def test_num_tokens_total_sets_the_output_length_as_megatrons_engine_does():
    from tknp_megatron.serving.megatron_types import to_engine_request

    req = to_engine_request([1, 2, 3, 4, 5], {"num_tokens_to_generate": None, "num_tokens_total": 12},
                            tokenizer=None, max_sequence_length=1024)
    assert req.params.max_new_tokens == 7
    req = to_engine_request([1, 2, 3], {"num_tokens_to_generate": None}, tokenizer=None, max_sequence_length=64)
    assert req.params.max_new_tokens == 61


@pytest.mark.parametrize("body, message", [
    ({"prompt": 5}, "'prompt' 5: expected text or a list, got int"),
    ({"messages": 5}, "'messages' 5: expected a list of messages, got int"),
    ({"messages": "hi"}, "'messages' 'hi': expected a list of messages, got str"),
    ({"messages": ["hi"]}, "'messages'[0] 'hi': expected an object with 'role' and 'content'"),
    ({"messages": [{"content": "hi"}]}, "'messages'[0].role None: must be one of system, developer, user"),
    ({"messages": [{"role": "user"}]}, "'messages'[0].content: expected text, got NoneType"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "'messages'[0].content: expected text, got a list of content parts"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "'messages': not valid Unicode (surrogates not allowed at character 1)"),
    ({"prompt": "\ud800"}, "'prompt': not valid Unicode (surrogates not allowed at character 0)"),
    ({"prompt": ["1 2", "x\udfff"]}, "'prompt': not valid Unicode"),
    ({"prompt": "1", "max_tokens": 10**400}, "'max_tokens' 100000000000... (401 digits): outside the 64-bit integer range"),
    ({"prompt": "1", "temperature": 10**400}, "'temperature' 100000000000... (401 digits): must be finite and >= 0"),
    ({"prompt": "1", "top_p": -10**400}, "'top_p' -10000000000... (402 digits): must be in [0, 1]"),
    ({"prompt": "1", "stop": 5}, "'stop' 5: expected text or a list of texts"),
    ({"prompt": "1", "stop": ["a", None]}, "'stop' ['a', None]: expected text or a list of texts"),
    ({"prompt": "1", "n": 2}, "'n' 2: Megatron's completions endpoint gives one choice per prompt"),
    ({"prompt": "1", "stream": True}, "'stream' true: this megatron-core's endpoints answer in one response"),
    ({"prompt": []}, "'prompt' is empty"),
    ({"prompt": [1, 2**64]}, "'prompt': token id 18446744073709551616 outside the vocabulary [0, 512)"),
    ({"prompt": [[1, 2], [3, 2**63]]}, "token id 9223372036854775808 outside the vocabulary [0, 512)"),
    ({"prompt": [-1, 5]}, "'prompt': token id -1 outside the vocabulary [0, 512)"),
    ({"prompt": [512]}, "'prompt': token id 512 outside the vocabulary [0, 512)"),
    ({"prompt": "1 2", "max_tokens": None}, "'max_tokens' is null"),
    ({"prompt": "1 2", "temperature": None}, "'temperature' is null"),
    ({"prompt": "1 2", "max_tokens": 1e20}, "'max_tokens' 1e+20: outside the 64-bit integer range"),
    ({"prompt": "1 2", "top_k": -(2**63) - 1}, "'top_k' -9223372036854775809: outside the 64-bit integer range"),
    ([1, 2], "request body is not a JSON object"),
    ({"prompt": "1 2", "max_tokens": [4]}, "'max_tokens' [4]: expected a number, got list"),
    ({"prompt": "1 2", "temperature": {}}, "'temperature' {}: expected a number, got dict"),
    ({"prompt": "1 2", "max_tokens": True}, "'max_tokens' True: expected a number, got a boolean"),
    ({"prompt": "1 2", "max_tokens": 4.5}, "'max_tokens' 4.5: must be a whole number"),
    ({"prompt": "1 2", "max_tokens": 0}, "'max_tokens' 0: must be at least 1"),
    ({"prompt": "1 2", "n": -1}, "'n' -1: must be in [1, 128]"),
    ({"prompt": "1 2", "temperature": float("inf")}, "'temperature' inf: must be finite and >= 0"),
    ({"prompt": "1 2", "top_p": 2}, "'top_p' 2: must be in [0, 1] (0 is off)"),
    ({"prompt": "1 2", "top_k": -1}, "'top_k' -1: must be >= 0 (0 is off)"),
    ({"prompt": "1 2", "logprobs": 513}, "'logprobs' 513: must be in [0, the vocabulary 512]"),
])
def test_http_bodies_megatrons_endpoints_would_answer_500_get_400(body, message):
    from tknp_megatron.serving.frontend import BodyRules, _body_problem

    rules, path = BodyRules(512), "/v1/chat/completions" if "messages" in body else "/v1/completions"
    problem = _body_problem("POST", body, rules, path)
    assert problem is not None and problem[1] == 400 and message in problem[0], problem
    assert "\n" not in problem[0] and len(problem[0]) < 300
    assert _body_problem("GET", body, rules, path) is None
    assert _body_problem("POST", body, rules, "/health") is None  # another route: the app answers it


@pytest.mark.parametrize("prompt, message", [
    ("1 2 3 ", "'prompt' '1 2 3 ': '' is not a token id; Megatron's null tokenizer takes ids in [0, 512) "
               "separated by single spaces"),
    ("1  2", "'' is not a token id"), ("1\t2", "'1\\t2' is not a token id"), ("hello", "'hello' is not a token id"),
    ("1 2 512", "'prompt': token id 512 outside the vocabulary [0, 512)"), ("1 -2", "'-2' is not a token id"), ("1 1_000", "'1_000' is not"),
    ("1 18446744073709551616", "token id 18446744073709551616 outside the vocabulary [0, 512)"), (["1 2", "3,4"], "'3,4' is not"),
    ("\u0661\u0662", "is not a token id"),  # Arabic-Indic digits: int() takes them, ids they are not
    ("1 " + "9" * 5000, "token id 999999999999... (5000 digits) outside the vocabulary [0, 512)"),
    ("x" * 5000, "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... (5002 characters): 'xxxx"),
])
def test_text_prompts_for_the_null_tokenizer_are_ids_or_get_400(prompt, message):
    """With Megatron's null tokenizer a text prompt is ids separated by single spaces (it
    runs ``int()`` on each piece of ``split(' ')``): anything else is answered 400 naming the
    piece, not 500 from the tokenizer, and an id beyond 64 bits never reaches the wire."""
    from tknp_megatron.serving.frontend import BodyRules, _body_problem

    problem = _body_problem("POST", {"prompt": prompt}, BodyRules(512, text_is_ids=True))
    assert problem is not None and problem[1] == 400 and message in problem[0], problem
    assert _body_problem("POST", {"prompt": prompt}, BodyRules(512)) is None  # a real tokenizer takes any text


def test_http_bodies_that_megatron_takes_pass():
    from tknp_megatron.serving.frontend import BodyRules, _body_problem

    ids = BodyRules(512, text_is_ids=True)
    for body in ({"prompt": "1 2 3", "max_tokens": 4, "temperature": 1e300, "logprobs": True},
                 {"prompt": [0, 2, 511], "top_k": 2**63 - 1}, {"prompt": ["0 511", "7"], "stop": ["3", "4 5"]},
                 {"prompt": "1", "max_tokens": 4.0, "top_p": 0, "top_k": 0, "n": 1, "seed": -1, "logprobs": 512,
                  "stop": "2", "stream": False}):
        assert _body_problem("POST", body, ids) is None, body
    for body in ({"messages": [{"role": "user", "content": "hi"}], "n": 2},
                 {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "h\u00e9 \U0001f600"},
                               {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                               {"role": "tool", "content": "42"}]}):
        assert _body_problem("POST", body, BodyRules(512), "/v1/chat/completions") is None, body
    assert _body_problem("POST", {"prompt": "1", "stream": True}, BodyRules(512, streams=True)) is None


def test_the_coordinators_sockets_drop_nothing_at_zmqs_high_water_mark():
    """A ROUTER at ZMQ's default marks (1000 messages each way) drops what it sends beyond
    them without a word: a burst of 20000 replies to a client that is not reading reaches it
    only in part. With :func:`unbounded_queues`, set after the connection is made (as the
    front end sets it on Megatron's coordinator and client), every one arrives."""
    import time

    import zmq

    from tknp_megatron.serving.coordinator_link import unbounded_queues

    def delivered(unbounded: bool) -> int:
        ctx = zmq.Context()
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"register")
        peer, _ = router.recv_multipart()
        if unbounded:
            unbounded_queues(router)
            unbounded_queues(dealer)
        for _ in range(20000):
            router.send_multipart([peer, b"x" * 2000])
        time.sleep(0.5)
        n = 0
        while dealer.poll(500):
            dealer.recv()
            n += 1
        router.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        return n

    assert delivered(False) < 20000  # ZMQ's default: the rest silently dropped
    assert delivered(True) == 20000


def test_a_reply_to_params_megatron_refuses_is_still_built():
    """The refusal's own reply carries Megatron's default sampling parameters in their place,
    so building it cannot raise in the pool's loop."""
    from tknp_megatron.serving.megatron_types import reply_item

    params = dict(return_log_probs=True, skip_prompt_log_probs=True, top_n_logprobs=2,
                  return_prompt_top_n_logprobs=True)
    item = reply_item(7, [1, 2, 3], params, tokenizer=None, failure="request 7: refused")
    status = item["requests"][0]["status"] if "requests" in item else item["status"]
    assert status == "FAILED"


@pytest.mark.parametrize("transient", [False, True])
def test_a_failure_says_whether_the_request_itself_was_refused(transient):
    """A refusal for what the request asks is a non-transient error (Megatron's endpoints
    answer 400); a request the server ended (a stop, a failing pool) a transient one (500)."""
    from tknp_megatron.serving.megatron_types import reply_item

    item = reply_item(7, [1, 2, 3], {}, tokenizer=None, failure="request 7: ended", transient=transient)
    request = item["requests"][0] if "requests" in item else item
    errors = [e for e in request["events"] if e["type"].startswith("ERROR")]
    assert [e["type"] for e in errors] == ["ERROR_TRANSIENT" if transient else "ERROR_NONTRANSIENT"]
    assert errors[0]["payload"]["message"] == "request 7: ended" and request["status"] == "FAILED"
