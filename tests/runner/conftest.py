"""Fixtures of the runner tests: `kernels` runs a test once per instruction-set variant of the native kernels."""

from __future__ import annotations

import pytest

from tests.fixtures.kernels import VARIANT_NAMES, require_kernels


@pytest.fixture(scope="module", params=VARIANT_NAMES)
def kernels(request):
    return require_kernels(request.param)
