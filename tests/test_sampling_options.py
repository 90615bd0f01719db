"""SamplingParams' rarer options against independent references: penalties and min_p on fixed logits against
transformers' logits processors (and OpenAI's formula), the engine's greedy tokens with them against transformers'
generate, and logprobs / prompt_logprobs against log_softmax of transformers' float32 logits."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from offload_engine import LLM, SamplingParams
from offload_engine.layers.logits_processing import apply_min_p, logits_processing, penalize
from tests.conftest import TEST_DEVICE
from tests.oracle import _hf_model, random_prompts

VOCAB = 50


def _seq(prompt, output, **params):
    return SimpleNamespace(token_ids=list(prompt) + list(output), num_prompt_tokens=len(prompt), seq_id=id(prompt),
                           completion_token_ids=list(output), params=SamplingParams(**params), min_tokens_bans=())


def _to_device(array, dtype):
    return torch.as_tensor(np.asarray(array)).to(dtype)


def test_penalties_match_transformers_repetition_and_openais_presence_and_frequency():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    rows = [_seq([1, 2, 3], [3, 4, 4, 4], repetition_penalty=1.3),
            _seq([5, 6], [7, 7, 8], presence_penalty=0.7, frequency_penalty=0.4),
            _seq([9], [10, 11, 10], repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5),
            _seq([12], [13], temperature=0)]  # no option: untouched
    got = penalize(logits, logits_processing(rows, _to_device))
    for r, seq in enumerate(rows):
        p, want = seq.params, logits[r : r + 1].clone().double()
        if p.repetition_penalty != 1:
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seq.token_ids]), want)
        counts = np.bincount(seq.completion_token_ids, minlength=VOCAB)
        want -= torch.from_numpy(p.frequency_penalty * counts + p.presence_penalty * (counts > 0))
        assert torch.allclose(got[r : r + 1].double(), want, atol=1e-5), r


def test_min_p_matches_transformers_and_leaves_rows_without_it_alone():
    gen = torch.Generator().manual_seed(1)
    scaled = torch.randn(3, VOCAB, generator=gen) * 2
    min_ps = torch.tensor([0.1, 0.0, 0.5])
    got = apply_min_p(scaled, min_ps)
    for r in range(3):
        want = scaled[r : r + 1] if min_ps[r] == 0 else MinPLogitsWarper(float(min_ps[r]))(None, scaled[r : r + 1])
        assert torch.equal(torch.isinf(got[r : r + 1]), torch.isinf(want))
        assert torch.equal(got[r][~torch.isinf(got[r])], scaled[r][~torch.isinf(got[r])])


def _hf_generate(model_dir, prompt, **kwargs):
    model = _hf_model(model_dir)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), [l[0].float() for l in out.logits]


@pytest.mark.parametrize("placement", ("gpu", "cpu"))
def test_greedy_with_a_repetition_penalty_equals_transformers(qwen3_dir, placement):
    prompts = random_prompts((14, 23), 256, seed=21)
    params = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.5, ignore_eos=True)
    with LLM(qwen3_dir, device=TEST_DEVICE, kv_placement=placement, num_cpu_blocks=16, cpu_block_size=16) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    want = [_hf_generate(qwen3_dir, p, max_new_tokens=12, repetition_penalty=1.5, min_new_tokens=12)[0]
            for p in prompts]
    assert got == want


def test_min_tokens_keeps_a_stop_token_from_being_drawn_before_it(qwen3_dir):
    prompt = random_prompts((17,), 256, seed=5)[0]
    with LLM(qwen3_dir, device=TEST_DEVICE) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
        stop = free[1]  # the greedy path's second token: a stop token ends it there without min_tokens
        params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], min_tokens=6, ignore_eos=True)
        got = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    want, _ = _hf_generate(qwen3_dir, prompt, max_new_tokens=10, min_new_tokens=6, eos_token_id=[stop])
    assert got == want and len(got) >= 6 and stop not in got[:6]


def test_logprobs_and_prompt_logprobs_are_transformers_log_softmax(qwen3_dir):
    prompt = random_prompts((19,), 256, seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    with LLM(qwen3_dir, device=TEST_DEVICE) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens, logits = _hf_generate(qwen3_dir, prompt, max_new_tokens=6, min_new_tokens=6)
    first = out.outputs[0]
    assert first.token_ids == tokens and len(first.logprobs) == 6
    for token, entry, step_logits in zip(tokens, first.logprobs, logits):
        lp = step_logits.double().log_softmax(-1)
        top = lp.topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        assert entry[token].logprob == pytest.approx(lp[token].item(), abs=1e-4) and entry[token].rank == 1
        for i, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[i].logprob == pytest.approx(value, abs=1e-4)
    assert first.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(tokens, first.logprobs)))
    with torch.no_grad():
        prompt_lp = _hf_model(qwen3_dir)(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry, want = out.prompt_logprobs[p], prompt_lp[p - 1]
        assert entry[prompt[p]].logprob == pytest.approx(want[prompt[p]].item(), abs=1e-4)
        assert entry[prompt[p]].rank == int((want > want[prompt[p]]).sum()) + 1
        assert set(want.topk(2).indices.tolist()) <= set(entry)


def test_requests_without_the_options_build_nothing():
    rows = [_seq([1, 2], [3]), _seq([4], [5, 6], temperature=0.5, top_k=3)]
    assert logits_processing(rows, _to_device) is None


def test_penalties_count_the_newest_token_while_its_step_is_in_flight(qwen3_dir, monkeypatch):
    # Async scheduling plans a step before the last one's token is read: the penalty must still see that token.
    from offload_engine.layers import sampler

    seen = []
    real = sampler.penalize
    monkeypatch.setattr(sampler, "penalize", lambda logits, proc: seen.append(
        int((proc.output_tokens >= 0).sum())) or real(logits, proc))
    prompt = random_prompts((11,), 256, seed=4)[0]
    with LLM(qwen3_dir, device=TEST_DEVICE) as llm:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, frequency_penalty=0.5),
                     use_tqdm=False)
    assert seen == list(range(8))  # the prefill's draw saw none, decode step k saw the k tokens made so far


@pytest.mark.parametrize("placement", ("cpu", "auto"))
def test_every_option_holds_on_the_host_lane_and_split_rows(qwen3_dir, placement):
    # Host-tier rows ("cpu"), and under "auto" a device pool too small for the prompts (split and host rows): the
    # same logprobs, penalties and min_tokens as the reference, whichever lane decodes.
    prompts = random_prompts((70, 90), 256, seed=13)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, repetition_penalty=1.4,
                            min_tokens=3, stop_token_ids=[7])
    with LLM(qwen3_dir, device=TEST_DEVICE, kv_placement=placement, num_gpu_blocks=6, num_cpu_blocks=16,
             cpu_block_size=16) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert placement == "cpu" or {o.kv_location for o in outputs} & {"split", "cpu"}
    for prompt, out in zip(prompts, outputs):
        tokens, logits = _hf_generate(qwen3_dir, prompt, max_new_tokens=8, repetition_penalty=1.4, min_new_tokens=3,
                                      eos_token_id=[7])
        assert out.token_ids == tokens
        for token, entry, step_logits in zip(tokens, out.outputs[0].logprobs, logits):
            # transformers' output_logits are the model's: the logprobs are of those, not of the penalized ones
            assert entry[token].logprob == pytest.approx(step_logits.double().log_softmax(-1)[token].item(), abs=1e-4)


def test_prompt_logprobs_across_prefill_chunks_and_logit_slices(qwen3_dir, monkeypatch):
    from offload_engine.layers import logits_processing

    monkeypatch.setattr(logits_processing, "PROMPT_LOGITS_ROWS", 7)  # several slices a chunk
    prompt = random_prompts((45,), 256, seed=17)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    with LLM(qwen3_dir, device=TEST_DEVICE, max_num_batched_tokens=16, prefill_graph_tokens=0) as llm:
        out = llm.generate([prompt, prompt[:20]], params, use_tqdm=False)[0]  # three chunks, beside another row
    with torch.no_grad():
        want = _hf_model(qwen3_dir)(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    assert [p for p in range(1, len(prompt)) if out.prompt_logprobs[p] is None] == []
    for p in range(1, len(prompt)):
        assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(want[p - 1][prompt[p]].item(), abs=1e-4)
