"""The single_turn environment: prompt files (JSONL, Parquet), chat prompts, length limit, the seeded and
resumable order, the reward function's checks, and a rollout through an engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.data.generator_output import validate_generator_output
from megatron_rl.environments.single_turn.config import DataConfig, RewardConfig
from megatron_rl.environments.single_turn.data import PromptOrder, read_rows, tokenize_rows
from megatron_rl.environments.single_turn.environment import SingleTurnEnvironment
from megatron_rl.environments.single_turn.reward import check_reward_function, load_reward_function, normalize
from megatron_rl.inference.builtin_engine import BuiltinEngine
from megatron_rl.inference.engine import SamplingSpec

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "arithmetic" / "train.jsonl"
REWARD = f"{ROOT / 'examples' / 'arithmetic' / 'reward.py'}:reward"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_rows([str(TRAIN)], "data.train_files")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert read_rows([str(tmp_path / "train.parquet")], "data.train_files") == rows
    both = read_rows([str(TRAIN), str(tmp_path / "train.parquet")], "data.train_files")
    assert both == rows + rows and rows[0] == {"prompt": "0 plus one equals", "answer": "1"}


@pytest.mark.parametrize("name, content, needle", [
    ("missing.jsonl", None, "is not a file"),
    ("rows.csv", "a,b\n", "neither JSONL"),
    ("bad.jsonl", "{not json\n", "cannot read"),
])
def test_bad_files_name_the_key(tmp_path, name, content, needle):
    if content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=f"data.train_files.*{needle}"):
        read_rows([str(tmp_path / name)], "data.train_files")


def test_data_config_accepts_a_path_or_a_list():
    assert DataConfig(train_files="a.jsonl").paths("train_files") == ["a.jsonl"]
    assert DataConfig(train_files=["a.jsonl", "b.parquet"]).paths("train_files") == ["a.jsonl", "b.parquet"]
    assert DataConfig().paths("val_files") == []
    with pytest.raises(ConfigError, match="data.train_files"):
        DataConfig(train_files=3)


def test_long_prompts_are_counted_and_skipped_never_truncated(word_tokenizer):
    rows = [{"prompt": "1 plus one equals", "answer": "2"}, {"prompt": "1 plus one plus one plus two equals"}]
    prompts = tokenize_rows(rows, word_tokenizer, prompt_key="prompt", max_prompt_tokens=4, files_key="data.x")
    assert prompts.skipped == 1 and [p.text for p in prompts.kept] == ["1 plus one equals"]
    assert prompts.kept[0].extra == {"answer": "2"} and len(prompts.kept[0].token_ids) == 4
    with pytest.raises(ConfigError, match="data.max_prompt_tokens"):
        tokenize_rows(rows, word_tokenizer, prompt_key="prompt", max_prompt_tokens=2, files_key="data.x")
    with pytest.raises(ConfigError, match="data.prompt_key='question'"):
        tokenize_rows(rows, word_tokenizer, prompt_key="question", max_prompt_tokens=9, files_key="data.x")


def test_chat_prompts_use_the_chat_template(word_tokenizer):
    messages = [{"role": "user", "content": "2 plus two equals"}]
    rows = [{"prompt": messages}]
    with pytest.raises(ConfigError, match="no chat template"):
        tokenize_rows(rows, word_tokenizer, prompt_key="prompt", max_prompt_tokens=9, files_key="data.x")
    word_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        prompts = tokenize_rows(rows, word_tokenizer, prompt_key="prompt", max_prompt_tokens=9, files_key="data.x")
    finally:
        word_tokenizer.chat_template = None
    assert prompts.kept[0].text == "2 plus two equals"
    assert prompts.kept[0].token_ids == word_tokenizer("2 plus two equals")["input_ids"]


def test_order_is_seeded_covers_every_row_per_epoch_and_resumes_exactly():
    straight = PromptOrder(7, seed=3, shuffle=True)
    batches = [straight.next(3) for _ in range(6)]  # 18 positions: 2 full epochs and 4 of the third
    flat = [i for b in batches for i in b]
    assert sorted(flat[:7]) == sorted(flat[7:14]) == list(range(7)) and flat[:7] != flat[7:14]
    assert PromptOrder(7, seed=3, shuffle=False).next(9) == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    first = PromptOrder(7, seed=3, shuffle=True)
    [first.next(3) for _ in range(2)]
    resumed = PromptOrder(7, seed=3, shuffle=True)
    resumed.consumed = first.consumed  # what a checkpoint carries
    assert [resumed.next(3) for _ in range(4)] == batches[2:]
    assert PromptOrder(7, seed=4, shuffle=True).next(7) != flat[:7]


def test_reward_function_from_a_file_or_a_module(tmp_path, monkeypatch):
    fn = load_reward_function(REWARD)
    assert normalize(fn(prompt="p", response="2", answer="2"), REWARD) == (1.0, {"first_word_right": 1.0})
    assert normalize(fn(prompt="p", response="2 2", answer="2"), REWARD) == (0.5, {"first_word_right": 1.0})
    (tmp_path / "my_rewards.py").write_text("def score(prompt, response, **kw):\n    return len(response)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_function("my_rewards:score")(prompt="", response="ab") == 2


@pytest.mark.parametrize("source, needle", [
    ("def other(prompt, response): return 1.0\n", "has no function 'fn'"),
    ("def fn(prompt, response, **kw): raise KeyError('x')\n", "raised KeyError"),
    ("def fn(prompt, response): return 1.0\n", "raised TypeError"),  # the row's `answer` column
    ("def fn(prompt, response, answer): return 'yes'\n", "returned 'yes'"),
    ("def fn(prompt, response, answer): return float('nan')\n", "finite number"),
    ("def fn(prompt, response, answer): return {'score': 1.0}\n", "without 'reward'"),
    ("raise ImportError('broken')\n", "importing"),
])
def test_reward_function_mistakes_name_the_function(tmp_path, source, needle):
    (tmp_path / "r.py").write_text(source)
    spec = f"{tmp_path / 'r.py'}:fn"
    with pytest.raises(ConfigError, match="reward.function=") as info:
        check_reward_function(load_reward_function(spec), spec, prompt="1 plus one equals", extra={"answer": "2"})
    assert needle in str(info.value) and spec in str(info.value)


def test_reward_function_spec_errors():
    with pytest.raises(ConfigError, match="must look like"):
        load_reward_function("reward.py")
    with pytest.raises(ConfigError, match="is not a file"):
        load_reward_function("no/such/file.py:fn")
    with pytest.raises(ConfigError, match="cannot import"):
        load_reward_function("no_such_module_xyz:fn")


def make_env(word_tokenizer, tmp_path, **data):
    data = {"train_files": str(TRAIN), "val_files": str(TRAIN), **data}
    return SingleTurnEnvironment(DataConfig(**data), RewardConfig(function=REWARD), word_tokenizer, seed=0,
                                 max_prompt_tokens=16)


def oracle_and_noise(word_tokenizer):
    """Next-token log-probs: the right digit after '... equals', then <eos>; uniform noise elsewhere."""
    vocab = len(word_tokenizer)
    ids = word_tokenizer.convert_tokens_to_ids
    names = {"one": 1, "two": 2}

    def next_token_logprobs(contexts):
        out = torch.full((len(contexts), vocab), -5.0)
        for row, context in enumerate(contexts):
            words = word_tokenizer.convert_ids_to_tokens(context)
            if words[-1] == "equals":
                out[row, ids(str((int(words[0]) + names[words[2]]) % 10))] = 5.0
            else:
                out[row, word_tokenizer.eos_token_id] = 5.0
        return torch.log_softmax(out, -1)

    return next_token_logprobs


def test_rollout_through_an_engine_and_evaluation(word_tokenizer, tmp_path):
    env = make_env(word_tokenizer, tmp_path)
    engine = BuiltinEngine(oracle_and_noise(word_tokenizer))
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=env.stop_token_ids)
    rollouts = env.rollout(engine, spec, num_prompts=4, n_samples_per_prompt=3, seed=11, step_wise=False)
    out = rollouts.output
    validate_generator_output(out, step_wise=False)
    assert len(out["response_ids"]) == 12 and out["uids"] == [i // 3 for i in range(12)]
    assert all(len(lp) == len(r) for lp, r in zip(out["rollout_logprobs"], out["response_ids"]))
    assert sum(out["rewards"]) / 12 > 0.5 and "reward_fn/first_word_right" in rollouts.metrics
    greedy = SamplingSpec(max_tokens=3, temperature=0.0, stop_token_ids=env.stop_token_ids)
    assert env.evaluate(engine, greedy, seed=0, num_prompts=None, pass_threshold=1.0).metrics == \
        {"eval/reward_mean": 1.0, "eval/pass_rate": 1.0}


def test_rollouts_after_a_restored_state_match_the_uninterrupted_run(word_tokenizer, tmp_path):
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=(word_tokenizer.eos_token_id,))
    engine = BuiltinEngine(oracle_and_noise(word_tokenizer))

    def prompts_of(env, steps):
        return [env.rollout(engine, spec, num_prompts=6, n_samples_per_prompt=2, seed=s, step_wise=False)
                .output["prompt_token_ids"] for s in steps]

    straight = prompts_of(make_env(word_tokenizer, tmp_path), range(1, 9))  # 48 positions: crosses 2 epochs
    interrupted = make_env(word_tokenizer, tmp_path)
    prompts_of(interrupted, range(1, 5))
    state = json.loads(json.dumps(interrupted.state_dict()))  # what the checkpoint stores
    resumed = make_env(word_tokenizer, tmp_path)
    resumed.load_state_dict(state)
    assert prompts_of(resumed, range(5, 9)) == straight[4:]


def test_a_reward_that_failed_on_another_rank_only_fails_here_too(word_tokenizer, tmp_path, monkeypatch):
    """The ranks agree on the failed responses (the union): one whose reward function raised on another rank only
    is a counted failure on this one too, so every rank trains on the same rows."""
    from megatron_rl.distributed import rank0

    monkeypatch.setattr(rank0, "union_over_ranks", lambda values: values | {4})  # rank 1's failure: response 4
    env = make_env(word_tokenizer, tmp_path)
    spec = SamplingSpec(max_tokens=3, temperature=1.0, stop_token_ids=env.stop_token_ids)
    rollouts = env.rollout(BuiltinEngine(oracle_and_noise(word_tokenizer)), spec, num_prompts=4,
                           n_samples_per_prompt=3, seed=11, step_wise=False)
    assert rollouts.metrics["rollout/failed_samples"] == 1 and len(rollouts.output["response_ids"]) == 11
    assert [f.index for f in rollouts.failures] == [4] and "failed on another rank" in rollouts.failures[0].error
