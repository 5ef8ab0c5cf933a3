"""A procedural training language: learnable in minutes on a CPU, generated from a seed.

Smoke tests, tutorials and CI need data that (a) exists without a download,
(b) a tiny model visibly learns within ~150 steps, and (c) has a right answer
to measure.  Each example is a prompt and its answer, one document per example:

* ``arithmetic``: ``417+38=455`` (operands of 1-3 digits);
* ``reverse``: ``rev abcde=edcba`` (3-8 lowercase letters);
* ``copy``: ``copy abcde=abcde``;
* ``mixed``: the three tasks in equal parts.

Documents are trained on whole (prompt and answer), like pretraining text: the
loss first drops as the model learns the format, then further as it learns the
answers.  Examples are unique by prompt, so a held-out split by document (what
``build_data`` does) never shares an example with training.
``synthetic_answer_accuracy`` measures the answers by greedy decoding.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerotrain.train.data.errors import DataError
from zerotrain.train.data.records import Document

TASKS = ("arithmetic", "reverse", "copy", "mixed")


@dataclass(frozen=True)
class SyntheticExample:
    """One example: the model reads ``prompt`` and should continue with ``answer``."""

    prompt: str
    answer: str

    @property
    def document(self) -> Document:
        return Document(text=self.prompt + self.answer)


def _number(rng: random.Random) -> int:
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _arithmetic(rng: random.Random) -> SyntheticExample:
    a, b = _number(rng), _number(rng)
    return SyntheticExample(f"{a}+{b}=", str(a + b))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))


def _reverse(rng: random.Random) -> SyntheticExample:
    word = _word(rng)
    return SyntheticExample(f"rev {word}=", word[::-1])


def _copy(rng: random.Random) -> SyntheticExample:
    word = _word(rng)
    return SyntheticExample(f"copy {word}=", word)


_GENERATORS: dict[str, Callable[[random.Random], SyntheticExample]] = {
    "arithmetic": _arithmetic,
    "reverse": _reverse,
    "copy": _copy,
}


def synthetic_examples(task: str = "arithmetic", num_examples: int = 20000, seed: int = 0) -> list[SyntheticExample]:
    """``num_examples`` distinct examples of ``task``, the same ones for the same seed on any machine.

    Uses ``random.Random``, whose integer sampling is stable across Python versions.
    """
    if task not in TASKS:
        raise DataError(f"data.synthetic.task {task!r} is not one of {', '.join(TASKS)}.")
    if num_examples < 1:
        raise DataError(f"data.synthetic.num_examples must be at least 1, got {num_examples}.")
    rng = random.Random(seed)
    tasks = list(_GENERATORS) if task == "mixed" else [task]
    examples: list[SyntheticExample] = []
    seen: set[str] = set()
    # Duplicates are rare (about a million distinct sums, far more words); the cap
    # only stops an impossible request from looping forever.
    for attempt in range(num_examples * 20):
        example = _GENERATORS[tasks[attempt % len(tasks)]](rng)
        if example.prompt not in seen:
            seen.add(example.prompt)
            examples.append(example)
            if len(examples) == num_examples:
                return examples
    raise DataError(f"data.synthetic: could not draw {num_examples} distinct {task} examples; ask for fewer.")


def synthetic_answer_accuracy(model: Any, tokenizer: Any, examples: list[SyntheticExample], *,
                              batch_size: int = 64) -> float:
    """Fraction of ``examples`` whose greedy continuation of the prompt is exactly the answer.

    Prompts start with BOS (when the tokenizer has a distinct one), as training
    documents do.  Every call runs the same number of forward passes for the same
    examples (no early stop), so all ranks of a ZeRO-3 job stay in step when they
    call it with the same list.  Runs under ``torch.no_grad`` on the model's device.
    """
    import torch

    if not examples:
        return 0.0
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id not in (None, tokenizer.eos_token_id) else None
    encoded = [([bos] if bos is not None else []) + tokenizer.encode(e.prompt, add_special_tokens=False)
               for e in examples]
    answers = [tokenizer.encode(e.answer, add_special_tokens=False) for e in examples]
    steps = max(len(a) for a in answers) + 1  # + EOS: "455" must not go on as "4551"
    device = next(model.parameters()).device
    # Equal-length prompts batch without padding or attention masks.
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    correct = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _, indices in sorted(by_length.items()):
                for start in range(0, len(indices), batch_size):
                    chunk = indices[start:start + batch_size]
                    ids = torch.tensor([encoded[i] for i in chunk], device=device)
                    for _ in range(steps):
                        logits = model(input_ids=ids).logits
                        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
                    produced = ids[:, -steps:].tolist()
                    for row, i in zip(produced, chunk):
                        want = answers[i] + [tokenizer.eos_token_id]
                        correct += row[:len(want)] == want
    finally:
        model.train(was_training)
    return correct / len(examples)
