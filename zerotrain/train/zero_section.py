"""The `zero` section of a train config (the DeepSpeed config) validated on its own terms.

Its problems are reported with keys named ``zero.<key>``, as the user wrote them in the
train YAML, next to the problems of the other sections (``validate_train_config``).
"""

from __future__ import annotations

from typing import Any, Mapping

from pydantic import BaseModel, ValidationError

from zerotrain.config.errors import ConfigError, describe_validation_error
from zerotrain.config.schema import ZeroTrainConfig


def validate_zero_section(zero: Mapping[str, Any], origin: str | None = None) -> ZeroTrainConfig:
    """The DeepSpeed section as a ZeroTrainConfig; ConfigError with ``zero.``-prefixed keys if invalid."""
    problems = zero_section_problems(zero)
    if problems:
        where = f" in {origin}" if origin else ""
        raise ConfigError(f"invalid zero (DeepSpeed) section{where}:\n" + "\n".join(f"  {p}" for p in problems))
    return ZeroTrainConfig.model_validate(dict(zero))


class _ZeroHolder(BaseModel):
    # Validating through a holder makes describe_validation_error name keys "zero.<key>".
    zero: ZeroTrainConfig


def zero_section_problems(zero: Mapping[str, Any]) -> list[str]:
    """One line per problem of the DeepSpeed section, keys named ``zero.<key>``; empty if it is valid."""
    try:
        _ZeroHolder.model_validate({"zero": dict(zero)})
    except ValidationError as error:
        return describe_validation_error(error, _ZeroHolder).splitlines()
    return []
