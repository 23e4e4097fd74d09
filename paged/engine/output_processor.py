"""The output processor (guide §13): a step's sampled tokens made into what a caller reads, as vLLM V1's
`OutputProcessor` (vllm/v1/engine/output_processor.py) does it.

    stops = output_processor.process_outputs(runner_output)   # logprobs decoded and recorded; stop strings found
    request_output = output_processor.make_request_output(request)

It detokenizes completions, finds the stop strings their new text completes (`stop_strings.py`), decodes the
logprob entries the model runner scored (`sampler.decode_logprobs`) onto the sequences and requests, and gives each
completion its finish and stop reasons. It runs after the scheduler's update has appended the step's tokens.
"""

import os

from paged.core.sequence import CompletionOutput, Request, RequestOutput, Sequence
from paged.engine.model_runner import ModelRunnerOutput
from paged.engine.sampler import decode_logprobs
from paged.engine.stop_strings import check_stop_strings


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int]):
        """tokenizer: a Hugging Face tokenizer, or None (texts are then empty); eos_token_ids: the model's."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def process_outputs(self, output: ModelRunnerOutput) -> list[tuple[Sequence, str]]:
        """Record the step's logprobs, decoded: on each request's prompt_logprobs, and on each sequence as many as
        the update appended (a stop may cut a verify short). Returns the sequences whose new text completes one
        of their stop strings, each with that string; the caller ends them (LLMEngine.step)."""
        for request, entries in output.prompt_logprobs:
            decode_logprobs(entries, self.tokenizer)
            request.prompt_logprobs += entries
        for seq, entries in output.logprobs:
            entries = entries[: seq.num_tokens - seq.num_prompt_tokens - len(seq.logprobs)]
            decode_logprobs(entries, self.tokenizer)
            seq.logprobs += entries
        return self.stop_strings(output.seqs, output.sampled_token_ids)

    def stop_strings(self, seqs: list[Sequence], tokens: list[list[int]]) -> list[tuple[Sequence, str]]:
        """The sequences whose new text (from their new tokens) completes one of their stop strings, each with the
        stop string found (engine/stop_strings.py)."""
        stopped = []
        for seq, new_tokens in zip(seqs, tokens):
            if not seq.params.stop or seq.stop_reason is not None:
                continue
            output = seq.output_token_ids
            text = self.decode(output)
            before = self.decode(output[: max(0, len(output) - len(new_tokens))])
            new_char_count = len(text) - len(os.path.commonprefix([before, text]))
            found = check_stop_strings(text, new_char_count, seq.params.stop, seq.params.include_stop_str_in_output)
            if found is not None:
                stopped.append((seq, found[0]))
        return stopped

    def make_request_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in request.seqs:
            output = CompletionOutput(
                seq.index,
                self.text(seq),
                list(seq.output_token_ids),
                seq.finish_reason,
                stop_reason=self.stop_reason(seq),
            )
            if seq.params.logprobs is not None:
                output.logprobs = list(seq.logprobs)
                output.cumulative_logprob = sum(
                    entry[token].logprob for entry, token in zip(seq.logprobs, seq.output_token_ids)
                )
            outputs.append(output)
        prompt_logprobs = None if request.params.prompt_logprobs is None else [None, *request.prompt_logprobs]
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            request.is_finished,
            request.metrics,
            prompt_logprobs,
        )

    def text(self, seq: Sequence) -> str:
        """A completion's text; one a stop string ended is cut before it (after it with include_stop_str_in_output)."""
        text = self.decode(seq.output_token_ids)
        if seq.stop_reason is None:
            return text
        return text[: check_stop_strings(text, len(text), [seq.stop_reason], seq.params.include_stop_str_in_output)[1]]

    def stop_reason(self, seq: Sequence) -> str | int | None:
        """vLLM's stop_reason: the stop string that ended the completion, or its stop token id; None after EOS."""
        if seq.stop_reason is not None or seq.finish_reason != "stop":
            return seq.stop_reason
        last = seq.output_token_ids[-1]
        ended_by_eos = last in self.eos_token_ids and not seq.params.ignore_eos
        return last if last in seq.params.stop_token_ids and not ended_by_eos else None

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
