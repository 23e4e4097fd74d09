"""Stop strings (guide §13): a completion ends when its text contains one of the request's stop strings.

They are matched on the detokenized text, not on token ids, so a stop string may span several tokens or end inside
one. The text is cut before the string (or after it, with include_stop_str_in_output); the token ids are kept whole,
as vLLM keeps them. Offline generation (LLMEngine) and the server's streams (AsyncLLM) both ask `check_stop_strings`,
vLLM's function of the same name and meaning (vllm/v1/engine/detokenizer.py): after each step, search only where a
stop string could end in the new text, and take the first stop string of the list that is found there.
"""


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str] | tuple[str, ...], include_in_output: bool
) -> tuple[str, int] | None:
    """The stop string found in the text's last new_char_count characters (or ending in them), with the length
    the text is cut to; None if there is none. Earlier text was searched when it was new."""
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)  # where one ending in new text begins
        index = output_text.find(stop_str, start)
        if index >= 0:
            return stop_str, index + len(stop_str) if include_in_output else index
    return None


def stop_hold_back(stop: list[str] | tuple[str, ...], include_in_output: bool) -> int:
    """Characters a stream keeps back at the end of its text: they may begin a stop string that would cut them."""
    if not stop or include_in_output:
        return 0
    return max(map(len, stop)) - 1
