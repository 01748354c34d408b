"""The request checks the plugin adds in SGLang's tokenizer manager (engine.request_checks), and
their hook (engine.hooks), without a server: each value a fuzz or catalogue run found crashing
the scheduler is refused with a ValueError (SGLang answers it with HTTP 400), and the values
around it still pass."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.hooks import _before_validate_one_request
from engine.request_checks import check_input_ids, check_top_logprobs_num

VOCAB = 49152


def test_input_ids_inside_the_vocabulary_pass():
    check_input_ids(VOCAB, None)
    check_input_ids(VOCAB, [0, 1, VOCAB - 1])


@pytest.mark.parametrize("ids, words", [
    ([1, -1], "outside the vocabulary"),
    ([VOCAB], "outside the vocabulary"),
    ([1 << 40], "outside the vocabulary"),
    ([1.5], "must be integers"),
    ([True], "must be integers"),
    ("1 2", "list of integers"),
])
def test_input_ids_refused(ids, words):
    with pytest.raises(ValueError, match=words):
        check_input_ids(VOCAB, ids)


@pytest.mark.parametrize("k", [None, 0, 1, 20, VOCAB, -1, [0, 5], [VOCAB, 1]])
def test_top_logprobs_up_to_the_vocabulary_pass(k):
    check_top_logprobs_num(VOCAB, k)  # negative means none upstream


@pytest.mark.parametrize("k", [VOCAB + 1, 10**6, [1, 10**6]])
def test_top_logprobs_above_the_vocabulary_refused(k):
    with pytest.raises(ValueError, match="at most the vocabulary size 49152"):
        check_top_logprobs_num(VOCAB, k)


def test_the_hook_applies_both_checks():
    manager = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))
    _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=5), [1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=0), [VOCAB])
    with pytest.raises(ValueError, match="top_logprobs_num"):
        _before_validate_one_request(manager, SimpleNamespace(top_logprobs_num=10**6), [1])
