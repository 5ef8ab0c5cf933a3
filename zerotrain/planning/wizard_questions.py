"""How the config wizard asks: one question at a time, each answer checked against what it accepts.

An answer comes from its flag when given, else from standard input (one line per answer; an
empty line takes the default shown in brackets), else, with `--yes` or once input has ended, the
default. A typed answer the question cannot use is asked again, with the reason and the answers
it accepts; a wrong flag, or a question with no default left unanswered, stops the wizard with
a `WizardError` naming the flag to pass. At a terminal the typed answer is not printed again
(the terminal has shown it); piped answers are printed after their prompt, so a transcript
reads as a session.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from zerotrain.config.byte_sizes import format_bytes, parse_byte_size


class WizardError(ValueError):
    """An answer that cannot be used, named with the question it answered."""


class BadAnswer(ValueError):
    """Why a typed answer cannot be used (the question adds what it accepts)."""


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""The default of a question that has none: it must be answered."""


@dataclass(frozen=True)
class Kind:
    """What a question accepts: `parse` turns text into the value (BadAnswer if it cannot),
    `accepts` lists the answers in words, `show` prints a value as the question would take it."""

    parse: Callable[[str], Any]
    accepts: str
    show: Callable[[Any], str] = str


@dataclass(frozen=True)
class LocalGpus:
    """The GPUs of the machine the wizard runs on, as torch.cuda sees them."""

    count: int = 0
    memory: int | None = None
    """Bytes of GPU 0; None without a GPU."""
    name: str | None = None


def local_gpus() -> LocalGpus:
    """This machine's GPUs (count, memory and name of GPU 0), or none when CUDA is not available."""
    import torch

    if not torch.cuda.is_available():
        return LocalGpus()
    props = torch.cuda.get_device_properties(0)
    return LocalGpus(torch.cuda.device_count(), int(props.total_memory), props.name)


@dataclass
class Answers:
    """What the wizard has learned so far."""

    values: dict[str, Any] = field(default_factory=dict)
    plan: Any = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


@dataclass
class Wizard:
    """Asks questions on `out`, reading answers from `inp`, flags first."""

    flags: dict[str, Any]
    assume_defaults: bool = False
    # Looked up when a wizard is made, so redirected streams are the ones used.
    inp: TextIO = field(default_factory=lambda: sys.stdin)
    out: TextIO = field(default_factory=lambda: sys.stdout)
    answers: Answers = field(default_factory=Answers)
    gpus: LocalGpus = field(default_factory=local_gpus)
    flag_names: dict[str, str] = field(default_factory=dict)
    """How the command line spells a question's flag when not --KEY (a positional MODEL)."""
    _input_ended: bool = False

    def say(self, text: str) -> None:
        """A line of the session (a note or a table)."""
        print(text, file=self.out, flush=True)

    def ask(self, key: str, prompt: str, kind: Kind, default: Any, note: str = "", hint: str = "") -> Any:
        """One question: its note (the estimate), the prompt with its default, the parsed answer.

        `hint` is shown only when the question is asked (not answered by its flag): words about
        this machine that would make a flag-answered transcript differ from machine to machine.
        """
        if note:
            self.say(note)
        flag = self.flag_names.get(key) or f"--{key.replace('_', '-')}"
        if hint and self.flags.get(key) is None:
            self.say(hint)
        if self.flags.get(key) is not None:
            text = str(self.flags[key])
            try:
                value = kind.parse(text.strip())
            except (BadAnswer, ValueError, TypeError) as error:
                raise WizardError(f"{flag} {text!r}: {_one_line(error)}; accepted answers: {kind.accepts}") from None
            self.say(f"{prompt}: {kind.show(value)} (from {flag})")
            return self._keep(key, value)
        required = default is REQUIRED
        shown = "" if required else f" [{kind.show(default)}]"
        while True:
            print(f"{prompt}{shown}: ", end="", file=self.out, flush=True)
            line = None if (self.assume_defaults or self._input_ended) else self.inp.readline()
            typed_here = line is not None and _is_terminal(self.inp)
            if line == "":
                self._input_ended = True
            if not line:  # --yes, or input has ended: the default, if there is one
                if required:
                    self.say("")
                    raise WizardError(f"{prompt}: this question has no default; pass {flag} "
                                      f"(accepted answers: {kind.accepts})")
                self.say(kind.show(default))
                return self._keep(key, default)
            text = line.strip()
            if not text and not required:
                if not typed_here:
                    self.say(kind.show(default))
                return self._keep(key, default)
            if not typed_here:  # a terminal has shown what was typed; piped input is shown here
                self.say(text)
            if not text:
                self.say(f"  an answer is needed (no default); accepted answers: {kind.accepts}")
                continue
            try:
                return self._keep(key, kind.parse(text))
            except (BadAnswer, ValueError, TypeError) as error:
                self.say(f"  {text!r}: {_one_line(error)}; accepted answers: {kind.accepts}")

    def _keep(self, key: str, value: Any) -> Any:
        self.answers.values[key] = value
        return value


def _one_line(error: BaseException) -> str:
    """A reason on one line, so "accepted answers" follows it (a model's reason may have several)."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


# --- what each question accepts -----------------------------------------------------------

def _whole_number(text: str) -> int:
    try:
        return int(text.strip().replace("_", "").replace(",", ""))
    except ValueError:
        raise BadAnswer("not a whole number") from None


def _positive(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise BadAnswer("must be at least 1")
    return value


def positive_int(example: str = "1") -> Kind:
    """A whole number, 1 or more."""
    return Kind(_positive, f"a whole number, 1 or more (e.g. {example})")


def multiple_of(n: int) -> Kind:
    """A whole number that the `n` GPUs divide."""
    def parse(text: str) -> int:
        value = _positive(text)
        if value % n:
            raise BadAnswer(f"not a multiple of the {n} GPUs")
        return value
    return Kind(parse, f"a multiple of {n} (the GPUs), e.g. {', '.join(str(n * k) for k in (1, 2, 4, 8))}")


def divisor_of(n: int) -> Kind:
    """A whole number dividing `n` (the samples each GPU takes per optimizer step)."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    listed = ", ".join(map(str, divisors)) if len(divisors) <= 12 else ", ".join(map(str, divisors[:11])) + ", ..."

    def parse(text: str) -> int:
        value = _positive(text)
        if n % value:
            raise BadAnswer(f"does not divide the {n} samples each GPU takes per step")
        return value
    return Kind(parse, f"a divisor of {n}: {listed}")


def _size(text: str) -> int:
    # The one size rule (config/byte_sizes.py): GiB = 2^30, GB = 10^9; "80" alone is refused, not 80 bytes.
    try:
        return parse_byte_size(text, require_unit=True)
    except ValueError as error:  # the wizard shows the answer itself before the reason
        raise BadAnswer(str(error).removeprefix(f"{text!r}: ")) from None


def show_size(value: int | None) -> str:
    """Bytes as a size answer would be typed, e.g. 80.0GiB; none for None."""
    return "none" if value is None else format_bytes(value).replace(" ", "")


GPU_MEMORY = Kind(_size, "a memory size with its unit, e.g. 24GiB or 80GiB (GiB = 2^30 bytes, GB = 10^9)", show_size)


def _size_or_none(text: str) -> int | None:
    return None if text.strip().lower() in ("0", "none") else _size(text)


CPU_MEMORY = Kind(_size_or_none, "a memory size with its unit, e.g. 512GiB or 1TiB; 0 or none: do not check",
                  show_size)


def choice(*options: Any, aliases: dict[str, Any] | None = None) -> Kind:
    """One of `options` (case-insensitive), or an alias of one."""
    def parse(text: str) -> Any:
        word = text.strip().lower()
        for option in options:
            if word == str(option).lower():
                return option
        if aliases and word in aliases:
            return aliases[word]
        raise BadAnswer("not one of the choices")
    return Kind(parse, f"one of {', '.join(str(o) for o in options)}")


def _yes_no(text: str) -> bool:
    word = text.strip().lower()
    if word in ("y", "yes", "true", "1"):
        return True
    if word in ("n", "no", "false", "0"):
        return False
    raise BadAnswer("not yes or no")


YES_NO = Kind(_yes_no, "yes or no (y/n)", lambda v: "yes" if v else "no")


def _checkpointing(text: str) -> bool | str:
    if text.strip().lower() in ("selective", "sel", "s"):
        return "selective"
    try:
        return _yes_no(text)
    except BadAnswer:
        raise BadAnswer("not no, selective or yes") from None


CHECKPOINTING = Kind(_checkpointing, "no, selective or yes",
                     lambda v: "selective" if v == "selective" else "yes" if v else "no")
"""Gradient checkpointing: no, selective (matmul and attention outputs kept) or yes (whole layers)."""


def _number(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise BadAnswer("not a number") from None


def _non_negative(text: str) -> float:
    if text.strip().lower() in ("none", "no", "off"):  # the prompt says "0: none"
        return 0.0
    value = _number(text)
    if value < 0:
        raise BadAnswer("is below 0")
    return value


NON_NEGATIVE = Kind(_non_negative, "a number, 0 or more (e.g. 1.0; 0 or none: no clipping)")


def _positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise BadAnswer("must be above 0")
    return value


LEARNING_RATE = Kind(_positive_float, "a number above 0, e.g. 3e-4 or 0.0001", lambda v: f"{v:g}")


def _folder(text: str) -> str:
    if not text.strip():
        raise BadAnswer("empty")
    return text.strip()


FOLDER = Kind(_folder, "a folder path, relative to this folder or absolute")


def model_kind(load: Callable[[str], Any]) -> Kind:
    """A model source that `load` can build (it raises ValueError saying why not)."""
    def parse(text: str) -> str:
        load(text)
        return text
    return Kind(parse, "a local Hugging Face model directory or its config.json, a zerotrain train YAML, or an "
                       "architecture name such as llama, mistral, qwen2 or gpt2 (a Hub id is not downloaded: "
                       "download its config.json and give its path)")
