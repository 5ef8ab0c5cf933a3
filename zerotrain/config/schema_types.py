"""The base of every config section and the field types the sections share."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from zerotrain.config.errors import AUTO, CUSTOM_ERROR_TYPE

Auto = Literal["auto"]
"""The placeholder DeepSpeed and Hugging Face use for "fill this in for me"."""

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]

AutoPositiveInt = PositiveInt | Auto
AutoNonNegativeInt = NonNegativeInt | Auto
AutoBool = bool | Auto

__all__ = [
    "AUTO",
    "Auto",
    "AutoBool",
    "AutoNonNegativeInt",
    "AutoPositiveInt",
    "ConfigSection",
    "Fraction",
    "NonNegativeFloat",
    "NonNegativeInt",
    "PositiveInt",
    "config_problem",
]


class ConfigSection(BaseModel):
    """A section of a zerotrain/DeepSpeed config: unknown keys are errors, and a
    key may be written either as its DeepSpeed JSON name (the alias) or as the
    attribute name."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
    )

    extra_accepted_keys: ClassVar[tuple[str, ...]] = ()
    """Keys a section accepts besides its fields (old spellings it translates);
    offered as "did you mean" suggestions too."""


def config_problem(message: str) -> PydanticCustomError:
    """An error for a validator to raise whose message reaches the user verbatim."""
    # Without a context dict pydantic leaves the template untouched, braces included.
    return PydanticCustomError(CUSTOM_ERROR_TYPE, message)
