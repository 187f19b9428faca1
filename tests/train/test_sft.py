"""SFT tokenization: the loss mask is exactly the assistant tokens, and the ids are the ones a rollout ledger holds.

The expectations here are built by hand from the raw SmolLM2 tokenizer (ChatML written out as text), not by
the chat layer under test; the rollout comparison drives the real agent loop, tools and ledger with an engine
that "samples" a fixed script of token ids.
"""

import asyncio
import json
from pathlib import Path

from turnrl.chat.parsers import HermesParser
from turnrl.chat.templates import tool_prompt
from turnrl.config import load_config
from turnrl.config.schema import RolloutConfig
from turnrl.data import load_dataset
from turnrl.data.rows import Task
from turnrl.engines.base import Completion, EngineBase
from turnrl.env.builtin.calculator import Calculator
from turnrl.ledger import Source
from turnrl.train.batching import to_rows
from turnrl.rollout.factory import build_environment, build_loop
from turnrl.train.sft import examples_from_tasks, load_examples

SYSTEM = "You are a helpful assistant."
QUESTION = "What is 17 * 23? Use the calculator."
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
ANSWER = "The result is 391.\n#### 391"
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
CONVERSATION = PROMPT + [
    {"role": "assistant", "content": CALL},
    {"role": "tool", "name": "calculator", "content": "391"},
    {"role": "assistant", "content": ANSWER}]
SCHEMAS = {"calculator": Calculator.schema}


def hand_built(tokenizer):
    """(ids, labels mask) of CONVERSATION in ChatML, each piece tokenized on its own; the assistant pieces are
    their content plus <|im_end|>, the only tokens the model writes (the `\\n` after it is template glue, and
    the ledger closes the last turn with it too, untrained, so the row is the template's full render)."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    system = f"{SYSTEM}\n\n{tool_prompt([Calculator.schema])}"  # SmolLM2's template ignores tools=: injected
    pieces = [
        (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
         "<|im_start|>assistant\n", None),
        (CALL, im_end),
        ("\n<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n", None),
        (ANSWER, im_end),
        ("\n", None)]
    ids, mask = [], []
    for text, end in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] + ([end] if end is not None else [])
        ids += piece
        mask += [int(end is not None)] * len(piece)
    return ids, mask


def sft_example(template, conversation=CONVERSATION, prompt_len=None):
    if prompt_len is None:
        task = Task(uid="t", messages=conversation, tools=["calculator"])
    else:  # the row's prompt, with a demonstration to learn
        task = Task(uid="t", messages=conversation[:prompt_len], tools=["calculator"],
                    demonstration=conversation[prompt_len:])
    examples, skipped = examples_from_tasks([task], template, SCHEMAS)
    assert skipped == 0 and len(examples) == 1
    return examples[0]


def test_labels_are_exactly_the_assistant_tokens(smol_tokenizer, smol_template):
    ids, mask = hand_built(smol_tokenizer)
    # The hand-written ChatML is what the real template renders.
    rendered = smol_tokenizer.apply_chat_template(
        [{"role": "system", "content": f"{SYSTEM}\n\n{tool_prompt([Calculator.schema])}"}] + CONVERSATION[1:],
        tokenize=False)
    assert smol_tokenizer(rendered, add_special_tokens=False)["input_ids"] == ids

    traj = sft_example(smol_template)
    seg = traj.segment
    assert traj.parity == "exact" and len(traj.segments) == 1
    assert seg.token_ids == ids
    assert seg.loss_mask == mask
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = [t for t, m in zip(ids, mask) if m]
    assert labels == (smol_tokenizer(CALL, add_special_tokens=False)["input_ids"] + [im_end]
                      + smol_tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [im_end])
    # What sft_epoch trains on: the batch row, its loss mask on the same tokens.
    batch = to_rows([traj], pad_id=smol_tokenizer.pad_token_id)
    assert batch.input_ids[0].tolist() == ids
    assert batch.input_ids[0][batch.loss_mask[0] == 1].tolist() == labels


def test_structured_tool_calls_train_the_same_tokens_as_hermes_text(smol_template):
    """OpenAI-style `tool_calls` (arguments as a JSON string) become the hermes text the policy would write."""
    structured = PROMPT + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calculator", "arguments": json.dumps({"expression": "17 * 23"})}}]},
        {"role": "tool", "name": "calculator", "content": "391"},
        {"role": "assistant", "content": ANSWER}]
    a, b = sft_example(smol_template, structured).segment, sft_example(smol_template).segment
    assert (a.token_ids, a.loss_mask) == (b.token_ids, b.loss_mask)


def test_few_shot_turns_in_the_prompt_are_not_trained(smol_tokenizer, smol_template):
    """calculator `demo: true` puts a worked example in the prompt: only the row's demonstration is a target."""
    task = load_dataset(None, "calculator", 1, 3, {"demo": True})[0]
    assert sum(m["role"] == "assistant" for m in task.messages) == 2  # the example's tool call and answer
    [traj], skipped = examples_from_tasks([task], smol_template, SCHEMAS)
    assert skipped == 0 and traj.parity == "exact"
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets = [m["content"] for m in task.demonstration if m["role"] == "assistant"]
    expected = [t for c in targets for t in smol_tokenizer(c, add_special_tokens=False)["input_ids"] + [im_end]]
    seg = traj.segment
    assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == expected
    first_target = seg.loss_mask.index(1)
    assert smol_tokenizer.decode(seg.token_ids[:first_target]).endswith(
        f"{task.messages[-1]['content']}<|im_end|>\n<|im_start|>assistant\n")


class ScriptedEngine(EngineBase):
    """Engine protocol stand-in for sampling: returns the next scripted token ids, records each prompt."""

    def __init__(self, replies: list[list[int]]):
        self.replies, self.prompts = list(replies), []

    async def generate(self, prompt_ids, sampling):
        self.prompts.append(list(prompt_ids))
        ids = self.replies.pop(0)
        return Completion(ids, [-0.5] * len(ids), "stop")

    async def update_weights(self, named_tensors, version):
        pass

    async def close(self):
        pass


def test_sft_tokens_equal_a_rollout_ledger(smol_tokenizer, smol_template):
    """The real loop (hermes parser, calculator tool, chat session) on scripted assistant turns builds the same
    ledger as SFT builds from the finished conversation: ids, loss mask and sources."""
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    script = [smol_tokenizer(c, add_special_tokens=False)["input_ids"] + [im_end] for c in (CALL, ANSWER)]
    engine = ScriptedEngine(script)
    cfg = RolloutConfig()
    loop = build_loop(cfg, engine, smol_template, build_environment(cfg), seed=0)
    rolled = asyncio.run(loop.run(Task(uid="t", messages=PROMPT, tools=["calculator"])))
    rolled.check()
    assert rolled.termination == "eos" and not rolled.errors and rolled.parity == "exact"
    assert rolled.turns[0].tool_results[0].text == "391"  # the tool really ran

    sft = sft_example(smol_template)
    assert rolled.segment.token_ids == sft.segment.token_ids == hand_built(smol_tokenizer)[0]
    assert rolled.segment.loss_mask == sft.segment.loss_mask
    assert rolled.segment.sources == sft.segment.sources
    policy = [i for i, s in enumerate(sft.segment.sources) if s == Source.POLICY]
    assert policy == [i for i, m in enumerate(sft.segment.loss_mask) if m]
    # Each turn was sampled from exactly the prefix SFT conditions that turn's tokens on.
    starts = [t.start for t in sft.turns]
    assert engine.prompts == [sft.segment.token_ids[:s] for s in starts]


def test_a_demonstration_row_gives_the_same_tokens_as_a_chat_row(smol_template):
    """A row's own assistant turns and a task's `demonstration` after its prompt are the same example."""
    a, b = sft_example(smol_template, prompt_len=len(PROMPT)).segment, sft_example(smol_template).segment
    assert (a.token_ids, a.loss_mask) == (b.token_ids, b.loss_mask)


def test_example_config_demonstrations_are_correct_exact_targets(smol_tokenizer, smol_template):
    """examples/calculator/sft.yaml: every generated demonstration becomes an example whose targets are its
    assistant turns, and its calculator call really computes the row's answer."""
    cfg = load_config(Path(__file__).parents[2] / "examples" / "calculator" / "sft.yaml", [])
    tasks = load_dataset(None, cfg.data.train.task, cfg.data.train.size, cfg.data.train.seed)
    examples, skipped = load_examples(cfg, smol_template)
    assert skipped == 0 and len(examples) == len(tasks) == 64
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for task, traj in zip(tasks, examples):
        assert traj.parity == "exact"
        call, answer = [m["content"] for m in task.demonstration if m["role"] == "assistant"]
        seg = traj.segment
        assert [t for t, m in zip(seg.token_ids, seg.loss_mask) if m] == (
            smol_tokenizer(call, add_special_tokens=False)["input_ids"] + [im_end]
            + smol_tokenizer(answer, add_special_tokens=False)["input_ids"] + [im_end])
        [parsed] = HermesParser().parse(call)
        assert Calculator().execute(parsed.arguments).text == task.ground_truth
        assert answer.endswith(f"#### {task.ground_truth}")
