"""What a vLLM offline script meets: RequestOutput / CompletionOutput, the prompt forms, get_tokenizer and chat."""
import numpy as np
import pytest

from offload_engine import LLM, SamplingParams
from offload_engine.completions import completion
from offload_engine.outputs import CompletionOutput, RequestOutput
from tests.conftest import TEST_DEVICE, with_tokenizer_config
from tests.oracle import hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def text_llm(text_model_dir):
    llm = LLM(text_model_dir, device=TEST_DEVICE)
    yield llm
    llm.close()


def test_outputs_are_shaped_as_vllms_and_keep_the_first_completions_fields(text_llm):
    outputs = text_llm.generate(["The quick brown fox", "Sequences whose KV"], GREEDY, use_tqdm=False)
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert len({o.request_id for o in outputs}) == 2 and all(isinstance(o.request_id, str) for o in outputs)
    for out in outputs:
        first = out.outputs[0]
        assert isinstance(first, CompletionOutput) and len(out.outputs) == 1 and first.index == 0 and first.finished()
        assert (out.text, out.token_ids, out.finish_reason) == (first.text, first.token_ids, first.finish_reason)
        assert first.text == text_llm.get_tokenizer().decode(first.token_ids, skip_special_tokens=True)
        assert out.prompt_token_ids == text_llm.get_tokenizer().encode(out.prompt)
        assert out.prompt_logprobs is None and first.logprobs is None and first.stop_reason is None


def test_a_stop_token_ends_the_completion_and_its_text_is_left_out(text_llm):
    prompt = "The quick brown fox"
    full = text_llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    stop = full[3]
    first = full.index(stop)
    out = text_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]),
                            use_tqdm=False)[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.text == text_llm.get_tokenizer().decode(full[:first], skip_special_tokens=True)


def test_every_prompt_form_gives_the_same_tokens(qwen3_dir):
    prompts = random_prompts((12, 20), 256, seed=3)
    expected = hf_greedy(qwen3_dir, prompts, GREEDY.max_tokens)
    with LLM(qwen3_dir, device=TEST_DEVICE) as llm:
        forms = [
            prompts,
            [np.array(p) for p in prompts],  # numpy arrays
            [[np.int64(t) for t in p] for p in prompts],  # numpy integers
            [{"prompt_token_ids": p} for p in prompts],  # vLLM's TokensPrompt
        ]
        for form in forms:
            assert [o.token_ids for o in llm.generate(form, GREEDY, use_tqdm=False)] == expected


def test_get_tokenizer_is_the_model_directorys(text_llm, text_model_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(text_model_dir)
    tokenizer = text_llm.get_tokenizer()
    for text in ("The quick brown fox", "0123 + <|endoftext|> é"):
        assert tokenizer.encode(text) == reference.encode(text)


def test_a_model_without_a_tokenizer_says_so(qwen3_dir):
    with LLM(qwen3_dir, device=TEST_DEVICE) as llm:
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.get_tokenizer()


@pytest.fixture(scope="module")
def chat_model_dir(text_model_dir, tmp_path_factory):
    return with_tokenizer_config(text_model_dir, tmp_path_factory.mktemp("chat") / "qwen3", chat_template=TEMPLATE)


def test_chat_renders_the_template_and_generates_from_it(chat_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    conversations = [[{"role": "user", "content": "The quick brown fox"}],
                     [{"role": "system", "content": "Pack my box"}, {"role": "user", "content": "jumps over"}]]
    rendered = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in rendered]
    with LLM(chat_model_dir, device=TEST_DEVICE) as llm:
        replies = llm.chat(conversations, GREEDY, use_tqdm=False)
        one = llm.chat(conversations[0], GREEDY, use_tqdm=False)
        assert [r.prompt for r in replies] == rendered and [r.prompt_token_ids for r in replies] == ids
        assert [r.token_ids for r in replies] == [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
        assert len(one) == 1 and one[0].token_ids == replies[0].token_ids
        with pytest.raises(ValueError, match="conversation"):
            llm.chat("hello", GREEDY)


def test_chat_without_a_template_says_how_to_give_one(text_llm):
    with pytest.raises(ValueError, match="chat_template"):
        text_llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    reply = text_llm.chat([{"role": "user", "content": "hi"}], GREEDY, chat_template=TEMPLATE, use_tqdm=False)[0]
    assert reply.prompt == "<|user|>hi\n<|assistant|>"


@pytest.mark.parametrize("placement", ("gpu", "cpu"))
def test_n_completions_share_the_prompts_blocks_and_the_ith_is_seeded_seed_plus_i(qwen3_dir, placement):
    prompt = random_prompts((40,), 256, seed=8)[0]  # 2 full blocks of 16 and a part
    sampled = dict(temperature=0.9, top_k=30, max_tokens=6)
    with LLM(qwen3_dir, device=TEST_DEVICE, block_size=16, cpu_block_size=16, kv_placement=placement,
             num_cpu_blocks=64) as llm:
        hits_before = llm.engine.blocks.num_prefix_hit_tokens
        out = llm.generate([prompt], SamplingParams(n=3, seed=11, **sampled), use_tqdm=False)[0]
        assert llm.engine.blocks.num_prefix_hit_tokens - hits_before == 2 * 32  # both siblings hit the 2 blocks
        assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
        alone = [llm.generate([prompt], SamplingParams(seed=11 + i, **sampled), use_tqdm=False)[0].token_ids
                 for i in range(3)]
        assert [c.token_ids for c in out.outputs] == alone and len({tuple(t) for t in alone}) > 1
        greedy = llm.generate([prompt, prompt[:9]], SamplingParams(n=2, temperature=0, max_tokens=5), use_tqdm=False)
        assert [len(o.outputs) for o in greedy] == [2, 2]
        assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids  # greedy: the same twice


def test_a_stop_string_ends_the_completion_where_its_text_shows_it(text_llm):
    prompt = "The quick brown fox"
    full = text_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    tokenizer = text_llm.get_tokenizer()
    # A stop string that ends inside the completion's third token: the completion keeps that token.
    upto = tokenizer.decode(full.token_ids[:3])
    stop = upto[-2:] if len(upto) >= 2 else upto
    first_end = next(k for k in range(1, 9) if stop in tokenizer.decode(full.token_ids[:k]))
    out = text_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop=[stop, "never seen"]),
                            use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[:first_end] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    text = tokenizer.decode(full.token_ids[:first_end])
    assert out.text == text[: text.find(stop)]
    kept = text_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop=stop,
                                                      include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_text_options_detokenize_and_skip_special_tokens(text_llm):
    from offload_engine.engine.sequence import Sequence

    prompt = "The quick brown fox"
    assert text_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, detokenize=False),
                             use_tqdm=False)[0].text == ""
    # A completion that shows a special token in its middle: kept in the text only where not skipped.
    tokenizer = text_llm.get_tokenizer()
    ids = tokenizer.encode("jumps") + [tokenizer.eos_token_id] + tokenizer.encode(" over")
    for skip in (True, False):
        seq = Sequence([1, 2], SamplingParams(skip_special_tokens=skip), budget=32)
        seq.token_ids += ids
        seq.finish_reason = "length"
        assert completion(0, seq, text_llm.tokenizer).text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<|endoftext|>" in tokenizer.decode(ids, skip_special_tokens=False)


def test_a_vllm_offline_script_runs_unchanged(chat_model_dir):
    # As vLLM's documentation writes it: several options at once, outputs[0].outputs[k].text, and chat.
    llm = LLM(model=chat_model_dir, device=TEST_DEVICE, seed=0)
    params = SamplingParams(n=2, temperature=0.8, top_p=0.95, stop=["\n", "fox"], logprobs=5, presence_penalty=0.5,
                            min_tokens=2, max_tokens=12, seed=3)
    outputs = llm.generate(["The quick brown fox", "Pack my box with"], params)
    for output in outputs:
        assert len(output.outputs) == 2 and isinstance(output.outputs[0].text, str)
        for sample in output.outputs:
            assert len(sample.token_ids) >= 2 and len(sample.logprobs) == len(sample.token_ids)
            assert all(len(entry) in (5, 6) for entry in sample.logprobs)  # the top 5, and the token if not
            assert "\n" not in sample.text and "fox" not in sample.text
            assert sample.finish_reason in ("stop", "length")
    replies = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=5))
    assert replies[0].outputs[0].text == replies[0].text and replies[0].prompt.endswith("<|assistant|>")
    llm.close()
