"""One test per third-party API distillq relies on, each failing on any warning the API raises.

The rest of the suite treats a third-party deprecation as an error only in the locked run; in CI's runs against
the newest and the lowest allowed versions (ops/deps.sh newest|floor) it is reported instead. These tests keep
failing there too (the ``filterwarnings("error")`` mark outranks the run's filters), so the report names the
API a new release deprecated or broke.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.demo.tinymodels import ensure_tiny_models  # noqa: E402
from pipeline.models.kvcache import NEW_NAME, OLD_NAME, cache_argument, output_cache, with_cache  # noqa: E402
from pipeline.models.weights import load_causal_lm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture(scope="module")
def model() -> Any:
    return load_causal_lm(ensure_tiny_models().student)


def test_transformers_from_pretrained_with_dtype_argument() -> None:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_models().student), dtype=torch.bfloat16)
    assert next(m.parameters()).dtype == torch.bfloat16


def test_transformers_forward_cache_argument_and_output_field(model: Any) -> None:
    """Incremental decoding through the cache keyword the forward declares equals one full forward."""
    import inspect

    declared = inspect.signature(type(model).forward).parameters
    assert cache_argument(model) in declared
    assert cache_argument(model) == (NEW_NAME if NEW_NAME in declared else OLD_NAME)
    ids = torch.tensor([[5, 9, 17, 33, 2, 41]])
    with torch.inference_mode():
        full = model(ids).logits[0]
        out = model(ids[:, :4], use_cache=True)
        step = model(ids[:, 4:], **with_cache(model, output_cache(out)), use_cache=True)
    torch.testing.assert_close(step.logits[0], full[4:], atol=1e-5, rtol=1e-5)


def test_transformers_decoder_takes_a_dynamic_cache_built_from_layer_pairs(model: Any) -> None:
    """Prefix sharing builds ``DynamicCache([(keys, values), ...], config=...)`` and reads ``cache.layers``."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    decoder = model.get_decoder()
    ids = torch.tensor([[3, 8, 13, 21, 34, 55]])
    with torch.inference_mode():
        full = decoder(ids).last_hidden_state[0]
        prefix = output_cache(decoder(ids[:, :3], use_cache=True))
        assert type(prefix) is DynamicCache and all(type(layer) is DynamicLayer for layer in prefix.layers)
        rebuilt = DynamicCache([(layer.keys, layer.values) for layer in prefix.layers], config=model.config)
        rest = decoder(ids[:, 3:], position_ids=torch.arange(3, 6)[None], **with_cache(decoder, rebuilt),
                       use_cache=True).last_hidden_state[0]  # fmt: skip
    torch.testing.assert_close(rest, full[3:], atol=1e-5, rtol=1e-5)


def test_transformers_tokenizer_chat_template_and_round_trip() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer))
    text = tok.apply_chat_template([{"role": "user", "content": "2+3"}], tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and "2+3" in text
    ids = tok.encode(text, add_special_tokens=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_numpy_zero_copy_views_used_by_the_wire() -> None:
    """The codec decodes arrays with ``np.frombuffer`` over message bytes, read-only and without a copy."""
    raw = np.arange(12, dtype="<f4").tobytes()
    view = np.frombuffer(memoryview(raw), dtype="<f4").reshape(3, 4)
    assert not view.flags.writeable and view.base is not None
    assert float(view[2, 3]) == 11.0


def test_no_warning_leaks_from_these_calls() -> None:
    """The mark above is in force: a warning inside one of these tests is an error."""
    with pytest.raises(DeprecationWarning):
        warnings.warn("probe", DeprecationWarning, stacklevel=1)
