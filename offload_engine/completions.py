"""How finished sequences become what generate() returns, with the text rules vLLM users expect: a stop token's or
stop string's text is left out unless include_stop_str_in_output (the token ids keep the token that ended it), and
stop strings are matched on the detokenized tail of each new token."""
from offload_engine.engine.sequence import Sequence
from offload_engine.outputs import CompletionOutput, Logprob, RequestOutput

STOP_WINDOW_SLACK = 8  # tokens decoded beyond a stop string's length in characters: a token may show part of one


def request_output(text: str | None, seqs: list[Sequence], tokenizer) -> RequestOutput:
    """One prompt's output: its SamplingParams.n sequences, the first of which holds the prompt's log-probabilities."""
    first = seqs[0]
    prompt_logprobs = None
    if first.params.prompt_logprobs is not None:
        prompt_logprobs = [None] + [_logprobs(first.token_logprobs.get(p), first.params.prompt_logprobs, tokenizer)
                                    for p in range(1, first.num_prompt_tokens)]
    return RequestOutput(request_id=str(first.seq_id), prompt=text,
                         prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
                         outputs=[completion(i, seq, tokenizer) for i, seq in enumerate(seqs)],
                         prompt_logprobs=prompt_logprobs, finished=all(seq.finish_reason is not None for seq in seqs),
                         kv_location=first.kv_location, kv_device_tokens=first.admitted_device_tokens,
                         kv_promoted=first.promoted, kv_demoted=first.demoted)


def completion(index: int, seq: Sequence, tokenizer) -> CompletionOutput:
    params, ids = seq.params, seq.completion_token_ids
    stop_reason, shown = seq.stop_string, ids
    if seq.finish_reason == "stop" and seq.stop_string is None and ids:
        stop_reason = ids[-1] if ids[-1] in params.stop_token_ids else None
        shown = ids if params.include_stop_str_in_output else ids[:-1]
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens) if params.detokenize else ""
        if seq.stop_string is not None:
            end = text.find(seq.stop_string)
            text = text[: end + len(seq.stop_string) if params.include_stop_str_in_output else end]
    logprobs = cumulative = None
    if params.logprobs is not None:
        entries = [seq.token_logprobs.get(p) for p in range(seq.num_prompt_tokens, len(seq))]
        logprobs = [_logprobs(entry, params.logprobs, tokenizer) for entry in entries]
        cumulative = sum(entry[1] for entry in entries if entry is not None)
    return CompletionOutput(index=index, text=text, token_ids=ids, cumulative_logprob=cumulative, logprobs=logprobs,
                            finish_reason=seq.finish_reason, stop_reason=stop_reason)


def _logprobs(entry: tuple | None, k: int, tokenizer) -> dict[int, Logprob] | None:
    """vLLM's per-token dict: the top-k ids (ranks 1..k) and the token itself, each with its text."""
    if entry is None:
        return None
    token, logprob, rank, top = entry
    text = (lambda i: tokenizer.decode([i], skip_special_tokens=False)) if tokenizer else (lambda i: None)
    found = {i: Logprob(lp, r + 1, text(i)) for r, (i, lp) in enumerate(top[:k])}
    found.setdefault(token, Logprob(logprob, rank, text(token)))
    return found


def matched_stop_string(tokenizer, seq: Sequence, length: int) -> str | None:
    """The first of seq's stop strings in the text of the tail of its first `length` tokens (the completion's only):
    enough tokens that any stop string ending in the newest one is whole there. The scheduler's stop_strings hook."""
    stops = seq.params.stop
    window = max(map(len, stops)) + STOP_WINDOW_SLACK
    tail = seq.token_ids[max(seq.num_prompt_tokens, length - window): length]
    text = tokenizer.decode(tail, skip_special_tokens=seq.params.skip_special_tokens)
    return next((stop for stop in stops if stop in text), None)
