"""``pipeline.serve.student``'s public names: the verifiers converter, loaded on first use."""

from __future__ import annotations

import pytest


def test_the_student_package_offers_its_public_converter() -> None:
    from pipeline.serve import student
    from pipeline.serve.student import verifiers

    assert student.__all__ and all(getattr(student, name) is getattr(verifiers, name) for name in student.__all__)
    with pytest.raises(AttributeError):
        _ = student.no_such_name
