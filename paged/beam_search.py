"""Beam search on shared blocks (guide §10): beams fork and die, and their block tables share every block
they have in common; only a partial last block is ever copied (copy-on-write, on the first write after a fork).

The search is vLLM's `LLM.beam_search` (vllm/entrypoints/generate/beam_search/offline.py). Each step runs one
forward pass over every live beam of every prompt and takes each beam's 2 * beam_width most likely next tokens as
candidates, scored by cumulative log-probability. A candidate that ends in an end-of-sequence token is a finished
hypothesis and is set aside; of the others, the best beam_width go on as the live beams. A kept candidate continues
its parent's sequence if it is the parent's first kept child, otherwise it forks the parent; a parent with no kept
child is freed. At max_tokens the live beams join the finished hypotheses, and the beam_width best by
`cum_logprob / num_generated_tokens ** length_penalty` (the generated tokens counting an ending EOS, vLLM's
`get_beam_search_score`) are the answer.
"""

from dataclasses import dataclass, field

import torch

from paged.core.sequence import Sequence
from paged.geometry import cdiv
from paged.sampling_params import SamplingParams
from paged.validation import integer, real


@dataclass
class BeamSearchSequence:
    token_ids: list[int]  # generated tokens
    cum_logprob: float
    text: str
    finished: bool  # ended in EOS (rather than at max_tokens)


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]  # best first
    # per forward pass: (physical blocks, block-table entries) of the live beams
    block_usage: list[tuple[int, int]] = field(default_factory=list)


def beam_search(
    engine, prompts, beam_width: int, max_tokens: int, length_penalty: float = 1.0
) -> list[BeamSearchOutput]:
    engine.require_idle("beam_search")
    vocab = engine.model.vocab_size
    beam_width, max_num_seqs = integer("beam_width", beam_width, low=1), engine.scheduler.max_num_seqs
    if beam_width > min(vocab // 2, max_num_seqs):
        raise ValueError(
            f"beam_width ({beam_width}) must be at most {min(vocab // 2, max_num_seqs)}: every beam is a "
            f"running sequence (max_num_seqs is {max_num_seqs}), and each step ranks 2 x beam_width "
            f"candidates per beam from a vocabulary of {vocab}"
        )
    length_penalty = real("length_penalty", length_penalty)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.make_request(p, params) for p in prompts]  # validates every prompt first
    if not requests:
        return []
    manager = engine.block_manager
    # A beam grows to at most max_tokens new tokens, and never past the model's context.
    limits = [min(max_tokens, engine.max_model_len - len(r.prompt_token_ids)) for r in requests]
    # Beams of one prompt must advance together, so a prompt runs only while all its beams fit at full length,
    # with one spare block per beam for a copy-on-write.
    need = [
        beam_width * (cdiv(len(r.prompt_token_ids) + limit, manager.block_size) + 1)
        for r, limit in zip(requests, limits)
    ]
    if max(need) > manager.num_blocks:
        raise ValueError(
            f"beam_width={beam_width} beams of up to {max_tokens} new tokens need {max(need)} blocks; "
            f"the pool has {manager.num_blocks}: lower beam_width or max_tokens, or raise num_blocks"
        )
    outputs, start = [], 0
    while start < len(requests):  # as many prompts at once as the pool holds
        end, blocks = start, 0
        while (
            end < len(requests)
            and blocks + need[end] <= manager.num_blocks
            and (end - start + 1) * beam_width <= engine.scheduler.max_num_seqs
        ):
            blocks += need[end]
            end += 1
        outputs += _search_group(engine, requests[start:end], beam_width, length_penalty)
        start = end
    return outputs


def _search_group(engine, requests, beam_width, length_penalty):
    for request in requests:
        engine.add_request(request)
    try:
        done, usage = _search(engine, requests, beam_width)
    except BaseException:  # an interrupt or an error: every beam gives its blocks back
        _release(engine, [seq for request in requests for seq in request.seqs if not seq.is_finished])
        raise
    finally:
        for request in requests:
            engine.requests.pop(request.request_id, None)
    results = []
    for request in requests:
        ranked = sorted(done[request.request_id], key=lambda d: -d[1] / max(len(d[0]), 1) ** length_penalty)[
            :beam_width
        ]
        sequences = [
            BeamSearchSequence(tokens, score, engine.output_processor.decode(tokens), ended)
            for tokens, score, ended in ranked
        ]
        results.append(BeamSearchOutput(request.prompt_token_ids, sequences, usage[request.request_id]))
    return results


def _search(engine, requests, beam_width):
    """Step the group's beams until every prompt is done."""
    live = {r.request_id: [(r.seqs[0], 0.0)] for r in requests}  # request -> [(sequence, cum logprob)]
    done = {r.request_id: [] for r in requests}  # request -> [(tokens, cum logprob, eos?)]
    usage = {r.request_id: [] for r in requests}
    while any(live.values()):
        with engine.transaction():  # a beam step happens whole or not at all, as LLMEngine.step does
            _step(engine, requests, live, done, usage, beam_width)
    return done, usage


def _step(engine, requests, live, done, usage, beam_width) -> None:
    """One forward pass over every live beam; each prompt sets its candidates that end in EOS aside and keeps its
    beam_width best others. The scheduler's update makes the kept candidates' forks and appends their tokens, and
    ends the beams at their length limit."""
    scheduler = engine.scheduler
    plan = scheduler.schedule()  # grows tables and makes this step's copy-on-write copies
    if not plan.scheduled:
        raise RuntimeError("beam search could not schedule its beams (a bug: groups are sized to fit the pool)")
    for request in requests:
        _record_usage(engine, live[request.request_id], usage[request.request_id])
    engine.begin_forward(plan)
    logits, sampled, _ = engine.model_runner.forward(plan, scheduler.running)
    logprobs = torch.log_softmax(logits, dim=-1)  # [len(sampled), vocab]
    row_of = {seq.seq_id: row for seq, row in sampled}
    chosen, dropped = [], []
    for request in requests:
        beams = live[request.request_id]
        if not beams or beams[0][0].seq_id not in row_of:
            continue  # finished, or its prompt is still being prefilled
        candidates, ends = [], engine.eos_token_ids
        for seq, score in beams:
            top = logprobs[row_of[seq.seq_id]].topk(2 * beam_width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                if token in ends:  # a finished hypothesis: set aside, it takes no live beam's place
                    done[request.request_id].append((seq.output_token_ids + [token], score + logprob, True))
                else:
                    candidates.append((score + logprob, seq, token))
        candidates.sort(key=lambda c: -c[0])
        kept = candidates[:beam_width]
        live[request.request_id] = _children(scheduler, plan, kept, chosen)
        continued = {seq for seq, _ in live[request.request_id]}  # a parent with a kept child continues as it
        dropped += [seq for seq, _ in beams if seq not in continued]
    finished = set(scheduler.update_from_output(plan, chosen))  # the forks, then the chosen tokens appended
    _release(engine, dropped)
    for request in requests:  # beams at max_tokens or the model's length have finished ("length")
        beams = live[request.request_id]
        done[request.request_id] += [(seq.output_token_ids, score, False) for seq, score in beams if seq in finished]
        live[request.request_id] = [(seq, score) for seq, score in beams if seq not in finished]


def _children(scheduler, plan, continuing, chosen) -> list[tuple[Sequence, float]]:
    """The live beams the kept candidates (score, parent, token) become: a parent's first kept child continues the
    parent, each other one is a new sequence forked from it in the plan (plan.forks). Their tokens join chosen."""
    beams, continued = [], set()
    for score, parent, tok in continuing:
        sequence = parent
        if parent.seq_id in continued:
            sequence = scheduler.new_sequence(parent.request)
            plan.forks.append((parent, sequence))
        continued.add(parent.seq_id)
        chosen.append((sequence, [tok]))
        beams.append((sequence, score))
    return beams


def _release(engine, seqs: list[Sequence]) -> None:
    """Beams that are dropped or done give their blocks back (shared blocks only lose one reference)."""
    if seqs:
        engine.scheduler.abort(seqs)


def _record_usage(engine, beams, history) -> None:
    """Blocks held at the forward pass, when every copy-on-write copy of this step has been made."""
    if not beams or beams[0][0].is_waiting:
        return  # finished, or its prompt waits for room in the token budget
    tables = [engine.block_manager.block_tables[seq.seq_id] for seq, _ in beams]
    history.append((len({block for table in tables for block in table}), sum(map(len, tables))))  # (physical, logical)
