"""Token-exact multi-turn (``environments/conversation.py``): the trained ids are the sampled ids on every turn;
a template that keeps history gives one merged sequence per conversation, one that strips earlier reasoning
(Qwen3) gives separate steps; the loss mask covers exactly the sampled tokens."""

from __future__ import annotations

import pytest
from tests.support.chat_helpers import KEEP_HISTORY, STRIP_REASONING, chat_tokenizer

from megatron_rl.data.merge import merge_stepwise_output
from megatron_rl.environments.conversation import Conversation, trajectory_rows
from megatron_rl.inference.builtin_engine import BuiltinEngine, uniform_next_token_logprobs
from megatron_rl.inference.engine import SamplingSpec


def play(conversation: Conversation, replies: list[str], observations: list) -> None:
    """Reply with each of ``replies`` (words), answering all but the last with the next observation."""
    tok = conversation.tokenizer
    for t, reply in enumerate(replies):
        ids = tok(reply, add_special_tokens=False)["input_ids"]
        conversation.add_response(ids, [-1.0] * len(ids), "stop")
        if t < len(observations):
            conversation.add_observation(observations[t])


def merged(conversation: Conversation) -> dict:
    rows = trajectory_rows(conversation.turns, reward=1.0, uid=0, trajectory_id=(0, 0))
    out = {name: [row[name] for row in rows] for name in rows[0]}
    return merge_stepwise_output(out)[0]


def assert_trains_exactly_the_sampled_tokens(conversation: Conversation, out: dict) -> None:
    """Per merged sequence, the loss-masked tokens are the sampled ids of its turns, in order, and nothing else."""
    sampled = [t.response_ids for t in conversation.turns]
    trained = []
    for response, mask, logprobs in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"]):
        trained.append([tok for tok, m in zip(response, mask) if m])
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask) if not m)  # observation tokens: no log-prob
    assert sum(trained, []) == sum(sampled, [])


def test_history_keeping_template_extends_every_turn_and_merges_to_one_sequence(tmp_path):
    tok = chat_tokenizer(tmp_path, KEEP_HISTORY)
    conv = Conversation(tok, "3 ?")
    assert conv.prompt_ids == tok("<|im_start|> user 3 ? <|im_end|> <|im_start|> assistant",
                                  add_special_tokens=False)["input_ids"]
    play(conv, ["4 <|im_end|>", "9 9 <|im_end|>", "6 <|im_end|>"], ["+ 5 ?", [{"role": "user", "content": "- 5 ?"}]])
    assert [t.extends for t in conv.turns] == [False, True, True] and conv.new_steps == 0
    for before, after in zip(conv.turns, conv.turns[1:]):
        assert after.prompt_ids[:len(before.prompt_ids) + len(before.response_ids)] == \
            before.prompt_ids + before.response_ids  # trained ids == sampled ids, kept in the next prompt
    # the last prompt is the template's rendering of the conversation before the last reply, token for token
    assert tok.decode(conv.turns[-1].prompt_ids) == tok.apply_chat_template(
        conv.messages[:-1], add_generation_prompt=True, tokenize=False).strip()
    out = merged(conv)
    assert len(out["response_ids"]) == 1 and out["prompt_token_ids"][0] == conv.turns[0].prompt_ids
    assert_trains_exactly_the_sampled_tokens(conv, out)


def test_template_that_strips_reasoning_starts_new_steps(tmp_path):
    tok = chat_tokenizer(tmp_path, STRIP_REASONING)
    conv = Conversation(tok, [{"role": "user", "content": "3 ?"}])
    replies = ["<think> 3 + </think> 4 <|im_end|>", "<think> 5 </think> 6 <|im_end|>", "<think> </think> 1 <|im_end|>"]
    play(conv, replies, ["+ 5 ?", "+ 0 ?"])
    assert [t.extends for t in conv.turns] == [False, False, False] and conv.new_steps == 2
    for turn, history in zip(conv.turns[1:], ([0, 1, 2], [0, 1, 2, 3, 4])):
        fresh = tok.apply_chat_template([conv.messages[i] for i in history], add_generation_prompt=True,
                                        tokenize=False)
        assert turn.prompt_ids == tok(fresh, add_special_tokens=False)["input_ids"]  # the fresh rendering
        assert tok.convert_tokens_to_ids("<think>") not in turn.prompt_ids  # earlier reasoning is gone
    out = merged(conv)
    assert len(out["response_ids"]) == 3  # nothing extends: one sequence per turn
    assert out["response_ids"] == [t.response_ids for t in conv.turns]
    assert_trains_exactly_the_sampled_tokens(conv, out)


def test_tool_results_keep_reasoning_so_turns_extend(tmp_path):
    """Qwen3 keeps the reasoning of the turns after the last user message: a tool loop extends."""
    tok = chat_tokenizer(tmp_path, STRIP_REASONING)
    conv = Conversation(tok, "3 ?")
    play(conv, ["<think> 1 </think> 7 <|im_end|>", "<think> 2 </think> 4 <|im_end|>"],
         [[{"role": "tool", "content": "+ 8"}]])
    assert [t.extends for t in conv.turns] == [False, True]
    out = merged(conv)
    assert len(out["response_ids"]) == 1
    assert_trains_exactly_the_sampled_tokens(conv, out)


def test_without_a_chat_template_text_is_raw_and_always_extends(tmp_path):
    tok = chat_tokenizer(tmp_path, None)
    conv = Conversation(tok, "3 ?")
    assert conv.prompt_ids == tok("3 ?")["input_ids"]
    play(conv, ["4 <|im_end|>", "<|im_end|>"], ["+ 5 ?"])
    assert conv.turns[1].prompt_ids == conv.turns[0].prompt_ids + conv.turns[0].response_ids + tok(
        "+ 5 ?", add_special_tokens=False)["input_ids"]
    assert_trains_exactly_the_sampled_tokens(conv, merged(conv))
    with pytest.raises(ValueError, match="no chat template"):
        Conversation(tok, [{"role": "user", "content": "3 ?"}])


@pytest.mark.parametrize("template", [KEEP_HISTORY, STRIP_REASONING])
def test_random_tokens_train_token_exact(tmp_path, template):
    """Uniformly random replies (special tokens, reasoning markers, truncation included): whatever the template
    does with them, the trained ids are the sampled ids and merging never loses or adds a trained token."""
    tok = chat_tokenizer(tmp_path, template)
    engine = BuiltinEngine(uniform_next_token_logprobs(len(tok)))
    spec = SamplingSpec(max_tokens=5, stop_token_ids=(tok.eos_token_id,))
    conversations = [Conversation(tok, "3 ?") for _ in range(16)]
    for turn in range(4):
        completions = engine.generate([c.prompt_ids for c in conversations], spec, seed=11)
        for c, completion in zip(conversations, completions):
            c.add_response(completion.token_ids, completion.logprobs, completion.finish_reason)
            assert c.turns[-1].response_ids == completion.token_ids
            if turn < 3:
                c.add_observation("+ 5 ?" if turn % 2 else [{"role": "tool", "content": "7"}])
    for c in conversations:
        assert_trains_exactly_the_sampled_tokens(c, merged(c))
    assert any(c.new_steps for c in conversations) and any(not c.new_steps for c in conversations)
