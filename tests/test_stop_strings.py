"""Stop strings offline (SamplingParams.stop), as vLLM's: matched on the detokenized text, also across tokens; the
text cut before the string (after it with include_stop_str_in_output), finish_reason "stop", stop_reason the string."""

import pytest
from helpers import assert_pool_empty, make_tiny_llm, random_prompts

from paged import SamplingParams
from paged.engine.stop_strings import check_stop_strings, stop_hold_back

pytestmark = pytest.mark.usefixtures("one_thread")


class PairTokenizer:
    """Token i decodes to two letters of its own, so a string of three letters always spans two tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) + chr(65 + i // 26) for i in ids)


@pytest.fixture
def llm(tiny_model):
    return make_tiny_llm(tiny_model, num_blocks=128, tokenizer=PairTokenizer())


@pytest.fixture
def greedy(llm):
    """A prompt, its 16 greedy tokens and their text."""
    prompt = random_prompts(1, seed=9)[0]
    tokens = (
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    return prompt, tokens, PairTokenizer().decode(tokens)


def test_check_stop_strings_searches_where_a_stop_string_could_end():
    assert check_stop_strings("abcdef", 2, ["cd"], False) is None  # ended before the new text
    assert check_stop_strings("abcdef", 2, ["de"], False) == ("de", 3)  # spans old and new text
    assert check_stop_strings("abcdef", 2, ["de"], True) == ("de", 5)
    assert check_stop_strings("abcdef", 3, ["f", "d"], False) == ("f", 5)  # the first of the list found wins
    assert check_stop_strings("abcdef", 0, ["f"], False) is None
    assert stop_hold_back(["abc", "de"], False) == 2 and stop_hold_back(["abc"], True) == 0


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_two_tokens_ends_the_text(llm, greedy, include):
    prompt, tokens, text = greedy
    stop = text[7:10]  # the second letter of token 3 and token 4's two: it spans two tokens
    index = text.index(stop)  # its first appearance (it may begin earlier in the text)
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: index + len(stop) if include else index]
    assert out.token_ids == tokens[: (index + len(stop) + 1) // 2]  # up to the token that completes it
    assert_pool_empty(llm)


def test_stop_strings_end_each_completion_on_its_own(llm, greedy):
    """Two prompts in one batch: the one whose text holds the stop string ends there, the other runs to max_tokens;
    a stop string that never appears changes nothing."""
    prompt, tokens, text = greedy
    other = random_prompts(1, seed=10)[0]
    stop = text[4:7]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["never seen", stop])
    plain = llm.generate([other], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    stopped, unaffected = [o.outputs[0] for o in llm.generate([prompt, other], params, use_tqdm=False)]
    assert (stopped.text, stopped.finish_reason) == (text[: text.index(stop)], "stop")
    assert stop not in plain.outputs[0].text
    assert unaffected.token_ids == plain.outputs[0].token_ids and unaffected.finish_reason == "length"
    assert unaffected.stop_reason is None
    assert_pool_empty(llm)


def test_stop_token_ids_give_their_id_as_stop_reason(llm, greedy):
    prompt, tokens, _ = greedy
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tokens[5]], ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", tokens[5])


@pytest.mark.parametrize("stop", ["", [""], ["a", 3], 7])
def test_bad_stop_strings_are_named(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


def test_include_stop_str_in_output_is_checked():
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")
