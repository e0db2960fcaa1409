"""The key/value cache of a transformers forward, under the name each allowed transformers version uses.

transformers 5.24 renamed the forward argument and the output field ``past_key_values`` to ``cache``
(the old name still works there, with a FutureWarning, until its announced removal in 5.40); earlier
releases know only ``past_key_values``. Every forward in distillq that passes or reads a cache goes
through these two functions, which ask the model's own signature rather than a version number.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

NEW_NAME = "cache"
OLD_NAME = "past_key_values"


@cache
def _argument_name(model_type: Any) -> str:
    params = inspect.signature(model_type.forward).parameters
    return NEW_NAME if NEW_NAME in params else OLD_NAME


def cache_argument(model: Any) -> str:
    """The keyword under which ``model``'s forward takes a key/value cache: ``cache`` or ``past_key_values``."""
    model_type: Any = type(model)
    return _argument_name(model_type)


def with_cache(model: Any, kv: Any) -> dict[str, Any]:
    """Keyword arguments that hand ``kv`` (a ``Cache`` or None) to ``model``'s forward."""
    return {cache_argument(model): kv}


def output_cache(out: Any) -> Any:
    """The key/value cache a forward returned (``out.cache`` on 5.24+, ``out.past_key_values`` before)."""
    fields = getattr(type(out), "__dataclass_fields__", {})
    return getattr(out, NEW_NAME if NEW_NAME in fields else OLD_NAME)
