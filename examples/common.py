"""Set-up shared by the examples: command line, a tiny local Qwen3 checkpoint, and hand-written rollouts.

Nothing here is part of the library; it only keeps the example scripts short. ``tiny_qwen3`` writes a
randomly initialized 2-layer Qwen3 (``transformers``) and a real word-level tokenizer (``tokenizers``, saved
with ``PreTrainedTokenizerFast``) into a directory: no downloads.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

WORDS = (
    "what is one two three four five six seven eight nine ten plus minus equals ? . , : "
    "name a colour red green blue yellow the sky grass are and or yes no"
).split()
SPECIAL = ["<pad>", "<unk>", "<eos>"]


def parse_args(doc: str | None, *, out_dir: bool = False, head_dim: int = 16) -> argparse.Namespace:
    """``--hf-dir`` (a local HF folder; default: a tiny random Qwen3 in a temporary directory), ``--tp``, and
    with ``out_dir=True`` ``--out-dir`` (default: a temporary directory)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", help="local Hugging Face checkpoint folder (default: a tiny random Qwen3)")
    parser.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size (launch with torchrun)")
    if out_dir:
        parser.add_argument("--out-dir", help="where to write the exported checkpoint (default: a temp dir)")
    args = parser.parse_args()
    if args.hf_dir is None:
        args.hf_dir = str(tiny_qwen3(_temporary_dir(), head_dim=head_dim))
    if out_dir and args.out_dir is None:
        args.out_dir = str(_temporary_dir())
    return args


def _temporary_dir() -> Path:
    """A directory removed when the process exits (each torchrun rank makes its own, identical, model)."""
    path = Path(tempfile.mkdtemp(prefix="megatron_rl_example_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def save_word_tokenizer(path: Path, words: Sequence[str] = WORDS, special: Sequence[str] = ()) -> int:
    """A whitespace word-level tokenizer over ``SPECIAL + words + special`` (pad ``<pad>`` id 0, eos ``<eos>`` id
    2; ``special``: tokens matched anywhere in the text, without spaces around them, e.g. a VL model's
    ``<|image_pad|>``); returns its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate([*SPECIAL, *words, *special])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                   **({"additional_special_tokens": list(special)} if special else {}))
    fast.save_pretrained(path)
    return len(vocab)


def tiny_qwen3(path: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """Save a random 2-layer Qwen3 (hidden 64, 4 heads of ``head_dim``, 2 KV heads, fp32) and its tokenizer in
    ``path`` (vLLM's CPU attention needs ``head_dim`` >= 32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar

    vocab_size = save_word_tokenizer(path)
    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, vocab_size=vocab_size, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def setup_policy(args: argparse.Namespace, *overrides: str):
    """``(groups, policy)``: config, process groups and a ``MegatronPolicy`` loaded from ``args.hf_dir``."""
    from megatron_rl.config import load_config
    from megatron_rl.distributed.bootstrap import initialize_distributed
    from megatron_rl.hf import policy_from_hf

    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; a plain `python` run is 1 process
    cfg = load_config(None, [f"parallel.tensor_model_parallel_size={args.tp}", *overrides], world_size=world_size)
    groups = initialize_distributed(cfg.parallel, cfg.seed)  # process groups (groups.tp_group, .dp_size, ...)
    policy = policy_from_hf(cfg, groups, hf_dir=args.hf_dir)  # shapes, pad id (policy.pad_token_id), weights
    return groups, policy


def example_rollouts(tokenizer) -> dict:
    """Two prompts, two sampled answers each (GRPO groups of 2), as a ``GeneratorOutput`` of plain lists."""
    prompts = ["what is two plus two ?", "name a colour : the sky is"]
    answers = [["four", "five"], ["blue", "green and yellow"]]
    rewards = [[1.0, 0.0], [1.0, 0.0]]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    responses = [ids(answer) + [tokenizer.eos_token_id] for group in answers for answer in group]
    return {
        "prompt_token_ids": [ids(prompt) for prompt, group in zip(prompts, answers) for _ in group],
        "response_ids": responses,
        "rewards": [reward for group in rewards for reward in group],  # one per sequence: on its last token
        "loss_masks": [[1] * len(response) for response in responses],  # 1 = train on this token
        "uids": [i for i, group in enumerate(answers) for _ in group],  # group id; a group's rows are contiguous
    }


def hf_logprobs(hf_dir: str, sequences, attention_mask, width: int):
    """``transformers``' log-probs of the same left-padded rows, right-aligned like ``forward``'s: ``[B, width]``.

    Column k is ``log p(sequences[:, S-width+k] | earlier tokens)`` (fp32, the model in fp32).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=attention_mask).logits  # [B, S, V]
    token_logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, sequences[:, 1:, None])[..., 0]  # [B, S-1]
    return token_logprobs[:, -width:]


def print0(*args: object) -> None:
    """Print on rank 0 only (torchrun sets RANK; a plain ``python`` run is rank 0)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, flush=True)
